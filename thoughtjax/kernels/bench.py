"""The kernel benchmark moved to :mod:`thoughtjax.bench.kernels`; this name stays for old imports
(``from thoughtjax.kernels import bench``) and ``python -m thoughtjax.kernels.bench``."""

import sys

from thoughtjax.bench import kernels as _kernels

if __name__ == "__main__":
  raise SystemExit(_kernels.main())
sys.modules[__name__] = _kernels  # one module object: attributes and monkeypatches are shared
