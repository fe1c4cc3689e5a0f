"""``python -m thoughtjax.cli``: the same as the ``thoughtjax`` command."""

from thoughtjax.cli import main

raise SystemExit(main())
