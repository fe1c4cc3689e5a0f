"""Key pairs: names with dots keep them."""

from __future__ import annotations

import pytest

from thoughtjax import signing
from thoughtjax.errors import UserError


@pytest.mark.parametrize(
  "given,stem",
  [("keys/team.v2", "team.v2"), ("keys/team", "team"), ("keys/team.key", "team"), ("keys/team.v2.pub", "team.v2")],
)
def test_keygen_writes_name_dot_key_and_name_dot_pub(tmp_path, given, stem):
  priv, pub = signing.keygen(tmp_path / given)
  assert (priv, pub) == (tmp_path / "keys" / f"{stem}.key", tmp_path / "keys" / f"{stem}.pub")
  assert priv.exists() and pub.exists() and priv.stat().st_mode & 0o777 == 0o600
  key = signing.load_private_key(priv)
  assert signing.key_id(key.public_key()) == signing.key_id(signing.load_public_key(pub))
  with pytest.raises(FileExistsError):
    signing.keygen(tmp_path / given)


def test_signature_errors_are_user_errors(tmp_path):
  bad = tmp_path / "bad.key"
  bad.write_text("not a key")
  with pytest.raises(UserError, match="bad.key: not an unencrypted PEM private key"):
    signing.load_private_key(bad)
