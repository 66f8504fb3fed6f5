"""Collect the wheels of ``configs/gpu/wheels.txt`` for one CPython version (``make gpu-wheels``).

``python -m pipeline.gpucheck.wheels [--python-version 3.12] [--dest .whl]`` downloads each pinned package as a
wheel for CPython on manylinux x86-64 (``pip download --no-deps --only-binary=:all:``), or builds it from the
pinned sdist where the list says so, into ``--dest``. A wheel already there is kept, so a second run downloads
nothing. The run fails, naming the file and the fix, when ``--dest`` holds a wheel that is not in the list (two
versions of one package stop ``pip install`` on the GPU machine) or when the set outgrows ``--max-mib``.
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from data_prep.safe_write import write_bytes

log = logging.getLogger("gpu-wheels")

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_LIST = ROOT / "configs" / "gpu" / "wheels.txt"
BUILDS = ("pure", "native")
# pip matches manylinux_2_N tags exactly, so every glibc level a wheel may name is offered.
PLATFORMS = [f"manylinux_2_{n}_x86_64" for n in (5, 12, 17, 24, 27, 28, 31, 34, 35, 39)]
PLATFORMS += ["manylinux2014_x86_64", "manylinux2010_x86_64", "manylinux1_x86_64"]
PIP_TIMEOUT_S = 900


class WheelError(RuntimeError):
    """A problem with the wheel list, a download or build, or the destination folder; the message names it."""


@dataclass(frozen=True)
class Pin:
    name: str
    version: str
    build: str | None

    @property
    def key(self) -> str:
        return normalize(self.name)


def normalize(name: str) -> str:
    """The name as a wheel file spells it (PEP 427: runs of ``-_.`` become one ``_``), lower case."""
    return re.sub(r"[-_.]+", "_", name).lower()


def read_pins(path: Path = DEFAULT_LIST) -> list[Pin]:
    """Parse ``name==version [build=pure|native]`` lines; ``#`` starts a comment."""
    pins: list[Pin] = []
    for number, raw in enumerate(path.read_text().splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        spec, *options = line.split()
        name, sep, version = spec.partition("==")
        build = options[0].removeprefix("build=") if options else None
        if not sep or not name or not version or len(options) > 1 or (options and build not in BUILDS):
            raise WheelError(f"{path}:{number}: {raw.strip()!r} is not 'name==version [build=pure|native]'")
        pins.append(Pin(name, version, build))
    keys = [p.key for p in pins]
    duplicates = sorted({k for k in keys if keys.count(k) > 1})
    if duplicates:
        raise WheelError(f"{path}: {', '.join(duplicates)} listed more than once; keep one version each")
    return pins


def wheel_fields(filename: str) -> tuple[str, str, str, str, str]:
    """(name, version, python tag, abi tag, platform tag) of a wheel file name."""
    parts = filename.removesuffix(".whl").split("-")
    if not filename.endswith(".whl") or len(parts) not in (5, 6):
        raise WheelError(f"{filename}: not a wheel file name")
    return parts[0], parts[1], parts[-3], parts[-2], parts[-1]


def fits(filename: str, python_version: str) -> bool:
    """Whether the wheel installs on CPython ``python_version`` on Linux x86-64."""
    cp = "cp" + python_version.replace(".", "")
    _, _, pys, abis, plats = wheel_fields(filename)
    py_ok = any(p in ("py3", cp) for p in pys.split("."))
    abi_ok = any(a in ("none", "abi3", cp) for a in abis.split("."))
    plat_ok = any(
        p == "any" or p == "linux_x86_64" or (p.startswith("manylinux") and p.endswith("_x86_64"))
        for p in plats.split(".")
    )
    return py_ok and abi_ok and plat_ok


def wheels_in(dest: Path) -> dict[str, tuple[str, str]]:
    """Normalized name -> (version, file name) of the wheels in ``dest``."""
    found: dict[str, tuple[str, str]] = {}
    for path in sorted(dest.glob("*.whl")):
        name, version, *_ = wheel_fields(path.name)
        if normalize(name) in found:
            raise WheelError(
                f"{dest}: two wheels of {name}: {found[normalize(name)][1]} and {path.name}; "
                "remove the one that is not pinned in configs/gpu/wheels.txt"
            )
        found[normalize(name)] = (version, path.name)
    return found


def _pip(args: list[str], what: str, env: dict[str, str] | None = None, python: str = sys.executable) -> None:
    done = subprocess.run([python, "-m", "pip", *args], capture_output=True, text=True, env=env, timeout=PIP_TIMEOUT_S)
    if done.returncode != 0:
        lines = [ln for ln in (done.stderr + done.stdout).splitlines() if ln.strip()] or ["(no output)"]
        errors = [ln for ln in lines if ln.startswith("ERROR")] or lines
        raise WheelError(f"{what} failed: {errors[-1].strip()}")


def _download_binary(pin: Pin, python_version: str, into: Path) -> bool:
    args = [
        "download",
        "--quiet",
        "--no-deps",
        "--only-binary=:all:",
        "--python-version",
        python_version,
        "--implementation",
        "cp",
        "--dest",
        str(into),
        f"{pin.name}=={pin.version}",
    ]
    for platform in PLATFORMS:
        args[1:1] = ["--platform", platform]
    try:
        _pip(args, f"pip download {pin.name}=={pin.version}")
    except WheelError:
        if pin.build == "native":
            return False  # built from the sdist below
        raise
    return True


def _build_from_sdist(pin: Pin, python: str, into: Path, env: dict[str, str] | None) -> None:
    sdists = into / "sdist"
    _pip(
        ["download", "--quiet", "--no-deps", "--no-binary=:all:", "--dest", str(sdists), f"{pin.name}=={pin.version}"],
        f"pip download of the {pin.name}=={pin.version} sdist",
    )
    (sdist,) = sdists.iterdir()
    # Pure builds run without build isolation: deepspeed's setup.py imports torch, which only this venv has.
    isolation = ["--no-build-isolation"] if pin.build == "pure" else []
    _pip(
        ["wheel", "--quiet", "--no-deps", *isolation, "--wheel-dir", str(into), str(sdist)],
        f"building a wheel of {pin.name}=={pin.version} with {python}",
        env=env,
        python=python,
    )


def target_python(python_version: str, given: str | None) -> str:
    """The interpreter for native builds: ``given``, this one if it is that version, else pythonX.Y on PATH
    (resolved to the real executable: a pyenv shim only runs a version that PYENV_VERSION selects)."""
    if given:
        return given
    if f"{sys.version_info.major}.{sys.version_info.minor}" == python_version:
        return sys.executable
    found = shutil.which(f"python{python_version}")
    fix = f"install it or pass --python /path/to/python{python_version}"
    if not found:
        raise WheelError(f"a native build needs CPython {python_version}: no python{python_version} on PATH; {fix}")
    probe = "import sys; print(sys.executable, '%d.%d' % sys.version_info[:2])"
    done = subprocess.run(
        [found, "-c", probe],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYENV_VERSION": python_version},
    )
    executable, _, version = done.stdout.strip().rpartition(" ")
    if done.returncode != 0 or version != python_version:
        raise WheelError(f"{found} does not run CPython {python_version}; {fix}")
    return executable


def fetch(pin: Pin, python_version: str, dest: Path, python: str | None) -> str:
    """Put the wheel of ``pin`` for ``python_version`` into ``dest``; returns its file name."""
    with tempfile.TemporaryDirectory(prefix="gca-wheel-") as tmp:
        work = Path(tmp)
        if pin.build == "pure":
            _build_from_sdist(pin, sys.executable, work, {**os.environ, "DS_BUILD_OPS": "0"})
        elif not _download_binary(pin, python_version, work):
            _build_from_sdist(pin, target_python(python_version, python), work, None)
        (wheel,) = work.glob("*.whl")
        name, version, *_ = wheel_fields(wheel.name)
        if normalize(name) != pin.key or version != pin.version or not fits(wheel.name, python_version):
            raise WheelError(
                f"{pin.name}=={pin.version}: got {wheel.name}, which is not that version for "
                f"CPython {python_version} on Linux x86-64"
            )
        write_bytes(dest / wheel.name, wheel.read_bytes())  # the work folder may be on another file system
        return wheel.name


def check_dest(pins: list[Pin], dest: Path, python_version: str, max_mib: float) -> int:
    """Fail unless ``dest`` holds exactly one fitting wheel per pin and nothing else; returns the total bytes."""
    present = wheels_in(dest)
    wanted = {p.key: p for p in pins}
    for key, (version, filename) in present.items():
        pin = wanted.get(key)
        if pin is None or pin.version != version or not fits(filename, python_version):
            why = (
                "is not in configs/gpu/wheels.txt"
                if pin is None
                else f"is not {pin.name}=={pin.version} for CPython {python_version}"
            )
            raise WheelError(f"{dest / filename} {why}; remove it (pip refuses two versions of one package)")
    missing = sorted(set(wanted) - set(present))
    if missing:
        raise WheelError(f"{dest}: no wheel for {', '.join(missing)}")
    total = sum((dest / filename).stat().st_size for _, filename in present.values())
    if total > max_mib * 2**20:
        raise WheelError(
            f"{dest}: the wheels take {total / 2**20:.1f} MiB, over --max-mib {max_mib} (the "
            "device tool carries 64 MiB for the whole working tree)"
        )
    return total


def collect(pins: list[Pin], python_version: str, dest: Path, python: str | None = None, max_mib: float = 40.0) -> int:
    """Fetch every missing wheel into ``dest`` and check the result; returns the total size in bytes."""
    dest.mkdir(parents=True, exist_ok=True)
    check_stale = wheels_in(dest)  # refuse a foreign wheel before spending time on downloads
    wanted = {p.key for p in pins}
    for key, (_, filename) in check_stale.items():
        if key not in wanted:
            raise WheelError(
                f"{dest / filename} is not in configs/gpu/wheels.txt; remove it (everything in "
                f"{dest} is installed on the GPU machine)"
            )
    for pin in pins:
        have = check_stale.get(pin.key)
        if have and have[0] == pin.version and fits(have[1], python_version):
            log.info("  have  %s", have[1])
            continue
        if have:
            raise WheelError(
                f"{dest / have[1]} is not {pin.name}=={pin.version} for CPython {python_version}; remove it"
            )
        log.info("  fetch %s==%s%s", pin.name, pin.version, f" (build={pin.build})" if pin.build else "")
        log.info("        %s", fetch(pin, python_version, dest, python))
    return check_dest(pins, dest, python_version, max_mib)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--python-version", default="3.12", help="target CPython X.Y (the GPU image: 3.12)")
    parser.add_argument("--dest", default=str(ROOT / ".whl"), help="folder for the wheels (default: .whl)")
    parser.add_argument("--list", default=str(DEFAULT_LIST), help="pinned wheel list")
    parser.add_argument("--python", help="CPython X.Y interpreter for build=native packages (default: pythonX.Y)")
    parser.add_argument("--max-mib", type=float, default=40.0, help="size limit of the whole set")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    if not re.fullmatch(r"3\.\d+", args.python_version):
        log.error("error: --python-version %r is not like 3.12", args.python_version)
        return 2
    try:
        pins = read_pins(Path(args.list))
        log.info("%d packages for CPython %s into %s", len(pins), args.python_version, args.dest)
        total = collect(pins, args.python_version, Path(args.dest), args.python, args.max_mib)
    except (WheelError, OSError, subprocess.TimeoutExpired) as err:
        log.error("error: %s", err)
        return 2
    log.info("%d wheels, %.1f MiB in %s", len(pins), total / 2**20, args.dest)
    return 0


if __name__ == "__main__":
    sys.exit(main())
