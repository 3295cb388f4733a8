"""The local VMs' image: the package cache every VM installs MaxText from carries compiled bytecode."""

from __future__ import annotations

import base64
import hashlib
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

from airflow_tpu_posttrain.local.stack import compile_package_bytecode

PYTHON = sys.executable
UV = shutil.which("uv") or str(Path(sys.executable).with_name("uv"))


def _wheel(directory: Path) -> Path:
    """A wheel with a module and a script in its ``.data/scripts`` (as pyelftools ships)."""
    files = {
        "tinypkg/__init__.py": "VALUE = 1\n",
        "tinypkg-1.0.data/scripts/tinytool.py": "print('tool')\n",
        "tinypkg-1.0.dist-info/METADATA": "Metadata-Version: 2.1\nName: tinypkg\nVersion: 1.0\n",
        "tinypkg-1.0.dist-info/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = []
    for name, text in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b"=").decode()
        record.append(f"{name},sha256={digest},{len(text.encode())}")
    record.append("tinypkg-1.0.dist-info/RECORD,,")
    wheel = directory / "tinypkg-1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        for name, text in files.items():
            archive.writestr(name, text)
        archive.writestr("tinypkg-1.0.dist-info/RECORD", "\n".join(record) + "\n")
    return wheel


def _install(venv: Path, wheel: Path, cache: Path) -> subprocess.CompletedProcess:
    subprocess.run([UV, "venv", "-q", "--python", PYTHON, str(venv)], check=True)
    env = {**os.environ, "UV_CACHE_DIR": str(cache)}
    return subprocess.run(
        [UV, "pip", "install", "--python", str(venv / "bin" / "python"), str(wheel)],
        env=env, capture_output=True, text=True,
    )


def test_a_venv_installed_from_the_compiled_cache_has_bytecode_and_wheels_with_scripts_still_install(tmp_path):
    wheel, cache = _wheel(tmp_path), tmp_path / "cache"
    first = _install(tmp_path / "first", wheel, cache)
    assert first.returncode == 0, first.stderr
    site = "lib/python3.12/site-packages/tinypkg/__pycache__"
    assert not (tmp_path / "first" / site).exists()  # what uv installs: sources only

    compile_package_bytecode(cache, PYTHON)
    assert (cache / ".bytecode-compiled").is_file()
    second = _install(tmp_path / "second", wheel, cache)
    assert second.returncode == 0, second.stderr  # uv refuses a directory among a wheel's scripts
    assert [p.name for p in (tmp_path / "second" / site).iterdir()] == ["__init__.cpython-312.pyc"]
    assert (tmp_path / "second" / "bin" / "tinytool.py").is_file()
