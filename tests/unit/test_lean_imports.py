"""``import raydl`` and the modules raydl's direct-path actors run leave torch unimported.

Those actors run pyarrow and numpy work; torch would cost each about 130 MB of
private memory (docs/design/embedded-runtime.md, "Lean"). The public names still import it on use.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

import raydl


@pytest.mark.timeout(60)
def test_importing_raydl_and_the_actor_modules_does_not_import_torch() -> None:
    code = (
        "import sys, raydl\n"
        "import raydl._internal.workers.worker, raydl._internal.epochs.direct\n"
        "import raydl._internal.io.parquet, raydl._internal.io.files\n"
        "assert 'torch' not in sys.modules, 'torch imported'\n"
        "raydl.RayDataLoader\n"
        "assert 'torch' in sys.modules\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=50)


def test_every_public_name_resolves_and_is_listed() -> None:
    for name in raydl.__all__:
        assert getattr(raydl, name) is not None
    assert raydl.__all__ == sorted(raydl.__all__)
    assert set(dir(raydl)) >= set(raydl.__all__)
    with pytest.raises(AttributeError, match="has no attribute 'nope'"):
        raydl.nope  # noqa: B018


@pytest.mark.timeout(60)
def test_the_boards_module_imports_neither_torch_nor_pyarrow_nor_numpy() -> None:
    # The board's actor starts on the path to every rank's first batch under torchrun;
    # its process imports only this module (importing torch took it ~1.7 s of CPU here).
    code = (
        "import sys, raydl._internal.epochs.board\n"
        "heavy = [m for m in ('torch', 'pyarrow', 'numpy') if m in sys.modules]\n"
        "assert not heavy, heavy\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=50)
