import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SHARED_DATA = REPO.parent / "shared" / "data"


@pytest.fixture(autouse=True, scope="session")
def _isolated_cache(tmp_path_factory):
    """Dataset and encoder caches go to a per-session folder, never the user's."""
    os.environ.setdefault("FLT_CACHE", str(tmp_path_factory.mktemp("flt-cache")))


def need_shared(name: str) -> Path:
    path = SHARED_DATA / name
    if not path.exists():
        pytest.skip(f"real data not found at {path} (../shared/data from the repo root)")
    return path
