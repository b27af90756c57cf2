"""Per-sandbox uids are drawn host-wide: two UidPools (two server processes, or two session actors
on one cluster node) sharing a claims folder never hand out the same uid to live sandboxes."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from coderunner.sandbox.identity import UidPool
from coderunner.vocabulary.host_identity import HostIdentity, IdentityError


def test_a_uid_held_by_one_pool_is_never_drawn_by_another(tmp_path: Path) -> None:
    claims = tmp_path / "uids"
    first, second = UidPool(span=4, claims_dir=claims), UidPool(span=4, claims_dir=claims)
    held = {first.allocate().uid for _ in range(3)}  # the whole (tiny) range: base+1 .. base+3
    assert len(held) == 3
    with pytest.raises(IdentityError, match="no free sandbox uid"):
        second.allocate()
    identity = next(iter(held))
    first.release(HostIdentity(f"uid {identity}", identity, identity))
    assert second.allocate().uid == identity  # freed by the first, so the second may take it
    assert stat.S_IMODE(os.stat(claims).st_mode) == 0o700  # host-only: no sandbox user can reach it


def test_without_a_claims_folder_a_pool_counts_only_its_own(tmp_path: Path) -> None:
    pool = UidPool(span=4)
    assert len({pool.allocate().uid for _ in range(3)}) == 3
    with pytest.raises(IdentityError):
        pool.allocate()
