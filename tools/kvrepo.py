"""What the monorepo holds: packages, their versions, pins, `_compat.py` ranges and tags.

Pure functions over a *tree*: either the working tree (`WorkTree`) or a git revision
(`GitTree`, read with `git show`), so that the release, skew and changed checks can read an
old release exactly as it was tagged. Nothing here installs or builds anything; the noxfile
does that. Only the standard library and `packaging` are used (nox itself depends on it).
"""

from __future__ import annotations

import ast
import re
import subprocess
import tomllib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Protocol

from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name
from packaging.version import InvalidVersion, Version

PACKAGES_DIR = "packages"
#: Bottom-up order of the layers; arrows only point down this list.
LAYERS = ("formats", "ops", "cutedsl", "vllm")
#: The dependency graph of the design (consumer -> providers). Pins read from each
#: pyproject.toml are added to it, so a new sibling requirement is picked up on its own.
DESIGN_GRAPH: Mapping[str, tuple[str, ...]] = {
    "formats": (),
    "ops": ("formats",),
    "cutedsl": ("formats",),
    "vllm": ("formats", "ops", "cutedsl"),
}
TAG_RE = re.compile(r"^kvarn-(?P<short>[a-z0-9]+)-v(?P<version>\d+(?:\.\d+)*\S*)$")


class Tree(Protocol):
    """Read-only view of the repository at some revision."""

    @property
    def label(self) -> str:
        """What the tree is, for messages ("working tree", "git kvarn-ops-v1.0.0")."""
        ...

    def read_text(self, rel: str) -> str | None:
        """Text of the file at `rel` (posix, relative to the repo root), or None."""
        ...

    def list_files(self, rel_dir: str) -> list[str]:
        """Every file below `rel_dir`, as repo-relative posix paths."""
        ...

    def list_dirs(self, rel_dir: str) -> list[str]:
        """Names of the direct sub-directories of `rel_dir`."""
        ...


@dataclass(frozen=True)
class WorkTree:
    """The files on disk under `root`."""

    root: Path
    label: str = "working tree"

    def read_text(self, rel: str) -> str | None:
        path = self.root / rel
        return path.read_text(encoding="utf-8") if path.is_file() else None

    def list_files(self, rel_dir: str) -> list[str]:
        base = self.root / rel_dir
        if not base.is_dir():
            return []
        return sorted(p.relative_to(self.root).as_posix() for p in base.rglob("*") if p.is_file())

    def list_dirs(self, rel_dir: str) -> list[str]:
        base = self.root / rel_dir
        if not base.is_dir():
            return []
        return sorted(p.name for p in base.iterdir() if p.is_dir())


@dataclass(frozen=True)
class GitTree:
    """The files of revision `ref` of the git repository at `root`."""

    root: Path
    ref: str
    label: str = ""

    def __post_init__(self) -> None:
        if not self.label:
            object.__setattr__(self, "label", f"git {self.ref}")

    def _git(self, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            ["git", "-C", str(self.root), *args], capture_output=True, text=True, check=False
        )

    def read_text(self, rel: str) -> str | None:
        proc = self._git("show", f"{self.ref}:{rel}")
        return proc.stdout if proc.returncode == 0 else None

    def list_files(self, rel_dir: str) -> list[str]:
        proc = self._git("ls-tree", "-r", "--name-only", self.ref, "--", rel_dir)
        return sorted(line for line in proc.stdout.splitlines() if line)

    def list_dirs(self, rel_dir: str) -> list[str]:
        proc = self._git("ls-tree", "-d", "--name-only", self.ref, "--", rel_dir.rstrip("/") + "/")
        return sorted(PurePosixPath(line).name for line in proc.stdout.splitlines() if line)


class RepoError(Exception):
    """A package's metadata cannot be read; the message says which file and why."""


@dataclass(frozen=True)
class Package:
    """One `packages/kvarn-<short>` directory as seen in one tree."""

    short: str
    version: str
    rel: str  # e.g. "packages/kvarn-ops"
    dependencies: tuple[str, ...]
    optional_dependencies: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    tree_label: str = "working tree"

    @property
    def name(self) -> str:
        return f"kvarn-{self.short}"

    @property
    def module(self) -> str:
        return f"kvarn_{self.short}"

    @property
    def tag(self) -> str:
        return tag_name(self.short, self.version)

    @property
    def compat_rel(self) -> str:
        return f"{self.rel}/src/{self.module}/_compat.py"

    def sibling_pins(self, *, include_extras: bool = False) -> dict[str, SpecifierSet]:
        """Sibling requirements, short name -> specifier (runtime deps, optionally extras)."""
        reqs = list(self.dependencies)
        if include_extras:
            for extra_reqs in self.optional_dependencies.values():
                reqs.extend(extra_reqs)
        pins: dict[str, SpecifierSet] = {}
        for raw in reqs:
            short = sibling_short(Requirement(raw).name)
            if short is not None and short != self.short:
                spec = Requirement(raw).specifier
                pins[short] = pins[short] & spec if short in pins else spec
        return pins

    @property
    def test_extra(self) -> bool:
        return "test" in self.optional_dependencies


def sibling_short(dist_name: str) -> str | None:
    """'kvarn-formats' / 'kvarn_formats' -> 'formats'; None for anything not ours."""
    name = canonicalize_name(dist_name)
    return name.removeprefix("kvarn-") if name.startswith("kvarn-") else None


def tag_name(short: str, version: str) -> str:
    return f"kvarn-{short}-v{version}"


def parse_tag(tag: str) -> tuple[str, Version] | None:
    """'kvarn-formats-v1.0.0' -> ('formats', Version('1.0.0')); None if not a release tag."""
    match = TAG_RE.match(tag.strip())
    if not match:
        return None
    try:
        return match["short"], Version(match["version"])
    except InvalidVersion:
        return None


def read_package(tree: Tree, short: str) -> Package | None:
    """The package `kvarn-<short>` in `tree`, or None when it has no pyproject.toml."""
    rel = f"{PACKAGES_DIR}/kvarn-{short}"
    text = tree.read_text(f"{rel}/pyproject.toml")
    if text is None:
        return None
    where = f"{rel}/pyproject.toml ({tree.label})"
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise RepoError(f"{where}: not valid TOML: {exc}") from exc
    project = data.get("project", {})
    if project.get("name") and canonicalize_name(project["name"]) != f"kvarn-{short}":
        raise RepoError(f"{where}: [project] name is {project['name']!r}, expected 'kvarn-{short}'")
    version = project.get("version")
    if not isinstance(version, str):
        raise RepoError(
            f'{where}: [project] needs a static version = "X.Y.Z" (the one version source); '
            "a dynamic version is not supported by the release tools"
        )
    try:
        Version(version)
    except InvalidVersion as exc:
        raise RepoError(f"{where}: version {version!r} is not a valid version") from exc
    deps = tuple(project.get("dependencies", []))
    optional = {k: tuple(v) for k, v in project.get("optional-dependencies", {}).items()}
    for raw in (*deps, *(r for reqs in optional.values() for r in reqs)):
        try:
            Requirement(raw)
        except Exception as exc:  # packaging raises InvalidRequirement
            raise RepoError(f"{where}: bad requirement {raw!r}: {exc}") from exc
    return Package(short, version, rel, deps, optional, tree.label)


def discover(tree: Tree) -> dict[str, Package]:
    """Every package under packages/ (layer order first, then any others by name)."""
    shorts = [
        d.removeprefix("kvarn-") for d in tree.list_dirs(PACKAGES_DIR) if d.startswith("kvarn-")
    ]
    ordered = [s for s in LAYERS if s in shorts] + sorted(s for s in shorts if s not in LAYERS)
    found = {}
    for short in ordered:
        pkg = read_package(tree, short)
        if pkg is not None:
            found[short] = pkg
    return found


def dependency_graph(packages: Mapping[str, Package]) -> dict[str, set[str]]:
    """consumer -> providers, for the packages present: the design graph plus every declared
    pin, extras included. What a change can affect; `runtime_graph` is what an install needs."""
    graph: dict[str, set[str]] = {}
    for short, pkg in packages.items():
        providers = set(DESIGN_GRAPH.get(short, ())) | set(pkg.sibling_pins(include_extras=True))
        graph[short] = {p for p in providers if p in packages and p != short}
    return graph


def runtime_graph(packages: Mapping[str, Package]) -> dict[str, set[str]]:
    """consumer -> providers it requires at run time (no extras): what an install pulls in."""
    return {
        short: {p for p in pkg.sibling_pins() if p in packages and p != short}
        for short, pkg in packages.items()
    }


def dependants(graph: Mapping[str, set[str]], shorts: Iterable[str]) -> set[str]:
    """`shorts` plus everything that depends on them, directly or not."""
    result = set(shorts)
    changed = True
    while changed:
        changed = False
        for consumer, providers in graph.items():
            if consumer not in result and providers & result:
                result.add(consumer)
                changed = True
    return result


def providers_closure(graph: Mapping[str, set[str]], short: str) -> list[str]:
    """Every package `short` needs, transitively, bottom-up (providers before consumers)."""
    seen: list[str] = []

    def visit(node: str) -> None:
        for provider in sorted(graph.get(node, ()), key=_layer_key):
            if provider not in seen:
                visit(provider)
                seen.append(provider)

    visit(short)
    return seen


def _layer_key(short: str) -> tuple[int, str]:
    return (LAYERS.index(short) if short in LAYERS else len(LAYERS), short)


def module_constants(source: str) -> dict[str, object]:
    """Module-level `NAME = <literal>` assignments of a Python file (never imported)."""
    constants: dict[str, object] = {}
    for node in ast.parse(source).body:
        targets: list[ast.expr] = []
        value: ast.expr | None = None
        if isinstance(node, ast.Assign):
            targets, value = node.targets, node.value
        elif isinstance(node, ast.AnnAssign) and node.value is not None:
            targets, value = [node.target], node.value
        for target in targets:
            if isinstance(target, ast.Name) and value is not None:
                try:
                    constants[target.id] = ast.literal_eval(value)
                except ValueError:
                    continue
    return constants


def read_compat(tree: Tree, pkg: Package) -> dict[str, object] | None:
    """Constants of the package's `_compat.py`, or None when it has none."""
    text = tree.read_text(pkg.compat_rel)
    return None if text is None else module_constants(text)


def find_format_api(tree: Tree, formats: Package) -> int | None:
    """The integer `FORMAT_API = N` defined at module level somewhere in kvarn_formats."""
    src = f"{formats.rel}/src/{formats.module}/"
    files = [f for f in tree.list_files(src) if f.endswith(".py")]
    # __init__.py first: a re-export there is the public value.
    files.sort(key=lambda f: (not f.endswith("/__init__.py"), f))
    for rel in files:
        text = tree.read_text(rel)
        if text is None or "FORMAT_API" not in text:
            continue
        try:
            value = module_constants(text).get("FORMAT_API")
        except SyntaxError:
            continue
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return None


def list_tags(root: Path) -> list[str]:
    proc = subprocess.run(
        ["git", "-C", str(root), "tag", "--list", "kvarn-*-v*"],
        capture_output=True,
        text=True,
        check=False,
    )
    return sorted(t for t in proc.stdout.splitlines() if t)


def released_versions(tags: Iterable[str], short: str) -> dict[Version, str]:
    """Version -> tag for every release tag of `kvarn-<short>`."""
    found: dict[Version, str] = {}
    for tag in tags:
        parsed = parse_tag(tag)
        if parsed and parsed[0] == short:
            found[parsed[1]] = tag
    return found


def changed_files(root: Path, git_range: str) -> list[str]:
    """Files touched by `git_range` ('A..B', 'A...B' or a single revision meaning 'REV..HEAD')."""
    spec = git_range if ".." in git_range else f"{git_range}..HEAD"
    proc = subprocess.run(
        ["git", "-C", str(root), "diff", "--name-only", spec],
        capture_output=True,
        text=True,
        check=False,
    )
    if proc.returncode != 0:
        raise RepoError(f"git diff --name-only {spec} failed: {proc.stderr.strip()}")
    return sorted(line for line in proc.stdout.splitlines() if line)


#: Files outside packages/ that change how every package is built or tested.
SHARED_INFRA = ("noxfile.py", "pyproject.toml", ".ci/", "tools/")


def packages_for_changes(
    files: Iterable[str], packages: Mapping[str, Package]
) -> tuple[set[str], bool]:
    """Packages to test for a list of changed files, and whether root tests/ are affected.

    A change under packages/kvarn-<x>/ selects x and everything depending on it; a change
    to the shared build/test machinery (noxfile, root pyproject, .ci/, tools/) selects all
    packages; a change under the root tests/ selects the integration tests. Other files
    (docs, README) select nothing.
    """
    graph = dependency_graph(packages)
    direct: set[str] = set()
    everything = False
    root_tests = False
    for path in files:
        parts = PurePosixPath(path).parts
        if len(parts) >= 2 and parts[0] == PACKAGES_DIR and parts[1].startswith("kvarn-"):
            short = parts[1].removeprefix("kvarn-")
            if short in packages:
                direct.add(short)
        elif parts and parts[0] == "tests":
            root_tests = True
        elif any(path == p or (p.endswith("/") and path.startswith(p)) for p in SHARED_INFRA):
            everything = True
    if everything:
        return set(packages), True
    return dependants(graph, direct), root_tests
