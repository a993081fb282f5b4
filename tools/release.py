"""Release, skew and change checks for the four kvarn wheels.

The noxfile's `release`, `skew`, `changed` and `tools` sessions call these functions; the
same checks run from the command line:

    python tools/release.py check kvarn-ops        # changelog + pins of one package
    python tools/release.py check --all            # every package in packages/
    python tools/release.py check --release ops    # ... and its tag must not exist yet
    python tools/release.py skew                   # the skew plan, and its problems
    python tools/release.py changed main..HEAD     # packages a range asks to test

Every problem is one line naming the package, what is wrong and how to fix it. The exit
status is 1 when there is any problem. Nothing here builds, installs, tags or uploads.
"""

from __future__ import annotations

import argparse
import datetime as dt
import re
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent))

from packaging.specifiers import SpecifierSet
from packaging.version import InvalidVersion, Version

from kvrepo import (
    LAYERS,
    GitTree,
    Package,
    RepoError,
    Tree,
    WorkTree,
    changed_files,
    discover,
    find_format_api,
    list_tags,
    packages_for_changes,
    providers_closure,
    read_compat,
    read_package,
    released_versions,
    runtime_graph,
)

HEADING_RE = re.compile(r"^##\s+(?P<rest>.*?)\s*$")
ENTRY_RE = re.compile(r"^(?P<version>\d+(?:\.\d+)*\S*) - (?P<date>\d{4}-\d{2}-\d{2})$")
RANGE_HINT = "a range like kvarn-formats>=1.0,<2"


# --------------------------------------------------------------------------- changelog


def check_changelog(tree: Tree, pkg: Package) -> list[str]:
    """The CHANGELOG.md has a dated `## X.Y.Z - YYYY-MM-DD` entry for the current version."""
    rel = f"{pkg.rel}/CHANGELOG.md"
    wanted = f"## {pkg.version} - {dt.date.today().isoformat()}"
    text = tree.read_text(rel)
    if text is None:
        return [
            f"{pkg.name}: {rel} is missing: create it with an entry '{wanted}' for {pkg.version}"
        ]
    sections: list[tuple[str, list[str]]] = []
    for line in text.splitlines():
        heading = HEADING_RE.match(line)
        if heading:
            sections.append((heading["rest"], []))
        elif sections and line.strip():
            sections[-1][1].append(line)
    current = Version(pkg.version)
    entries: dict[Version, tuple[str, list[str]]] = {}
    problems: list[str] = []
    for rest, body in sections:
        entry = ENTRY_RE.match(rest)
        if entry is None:
            if _mentions_version(rest, pkg.version):
                problems.append(
                    f"{pkg.name}: {rel} heading '## {rest}' is not in the form "
                    f"'## X.Y.Z - YYYY-MM-DD': write it as '{wanted}' (with the release date)"
                )
            continue
        try:
            version = Version(entry["version"])
            dt.date.fromisoformat(entry["date"])
        except (InvalidVersion, ValueError):
            problems.append(f"{pkg.name}: {rel} heading '## {rest}' has a bad version or date")
            continue
        entries[version] = (rest, body)
    if current not in entries:
        if not problems:
            problems.append(
                f"{pkg.name}: {rel} has no entry for version {pkg.version} (the version in "
                f"{pkg.rel}/pyproject.toml): add '{wanted}' with what changed, "
                "or set the version back to the released one"
            )
    elif not entries[current][1]:
        problems.append(
            f"{pkg.name}: {rel} entry '## {entries[current][0]}' is empty: say what changed "
            f"in {pkg.version}"
        )
    newer = sorted(v for v in entries if v > current)
    if newer:
        problems.append(
            f"{pkg.name}: {rel} has an entry for {newer[-1]}, newer than the version "
            f'{pkg.version} in pyproject.toml: set version = "{newer[-1]}" in '
            f"{pkg.rel}/pyproject.toml or remove the entry"
        )
    return problems


def _mentions_version(text: str, version: str) -> bool:
    return re.search(rf"(?<![\d.]){re.escape(version)}(?![\d.])", text) is not None


# --------------------------------------------------------------------------- pins vs _compat


def split_range(spec: SpecifierSet) -> tuple[str | None, str | None, list[str]]:
    """'>=1.0,<2' -> ('1.0', '2', []); any other clause is returned in the third item."""
    low = high = None
    other = []
    for clause in spec:
        if clause.operator == ">=" and low is None:
            low = clause.version
        elif clause.operator == "<" and high is None:
            high = clause.version
        else:
            other.append(str(clause))
    return low, high, other


def _same_version(a: object, b: str) -> bool:
    try:
        return Version(str(a)) == Version(b)
    except InvalidVersion:
        return False


def check_pins(tree: Tree, pkg: Package) -> list[str]:
    """Sibling pins in pyproject.toml agree with the `_compat.py` constants.

    For a requirement `kvarn-<sib>>=A,<B` the `_compat.py` of the consumer must have
    `<SIB>_MIN = "A"` and `<SIB>_MAX = "B"`, and a consumer of kvarn-formats must have an
    integer `FORMAT_API_MIN`. Pins inside extras are checked when `_compat.py` names them.
    """
    pins = pkg.sibling_pins()
    all_pins = pkg.sibling_pins(include_extras=True)
    compat = read_compat(tree, pkg)
    pyproject = f"{pkg.rel}/pyproject.toml"
    problems: list[str] = []
    if compat is None:
        if pins:
            wanted = ", ".join(_compat_lines(pins))
            problems.append(
                f"{pkg.name}: {pyproject} pins {_fmt_pins(pins)} but {pkg.compat_rel} is "
                f"missing: copy the _compat.py template from kvarn-formats and set {wanted}"
            )
        return problems
    for short, spec in all_pins.items():
        key = short.upper()
        in_extra = short not in pins
        if in_extra and f"{key}_MIN" not in compat and f"{key}_MAX" not in compat:
            continue
        low, high, other = split_range(spec)
        req = f"kvarn-{short}{spec}"
        if low is None or high is None or other:
            problems.append(
                f"{pkg.name}: {pyproject} pin '{req}' must be {RANGE_HINT} (>=MIN,<MAX only): "
                f"write kvarn-{short}>={compat.get(f'{key}_MIN', 'MIN')},"
                f"<{compat.get(f'{key}_MAX', 'MAX')}"
            )
            continue
        for const, bound in ((f"{key}_MIN", low), (f"{key}_MAX", high)):
            value = compat.get(const)
            if value is None:
                problems.append(
                    f"{pkg.name}: {pkg.compat_rel} has no {const} but {pyproject} pins '{req}': "
                    f'add {const} = "{bound}"'
                )
            elif not _same_version(value, bound):
                problems.append(
                    f"{pkg.name}: pin mismatch: {pyproject} pins '{req}' but {pkg.compat_rel} "
                    f'has {const} = "{value}": make them agree (set {const} = "{bound}", or '
                    f"change the pin to kvarn-{short}"
                    f"{_with_bound(low, high, const.endswith('_MIN'), str(value))})"
                )
    if "formats" in pins:
        api_min = compat.get("FORMAT_API_MIN")
        if not isinstance(api_min, int) or isinstance(api_min, bool) or api_min < 1:
            problems.append(
                f"{pkg.name}: {pkg.compat_rel} needs an integer FORMAT_API_MIN >= 1 (the oldest "
                f"kvarn_formats.FORMAT_API it works with), found {api_min!r}"
            )
    for const in sorted(compat):
        match = re.fullmatch(r"([A-Z]+)_(MIN|MAX)", const)
        if match and match[1].lower() not in all_pins:
            problems.append(
                f"{pkg.name}: {pkg.compat_rel} has {const} but {pyproject} has no "
                f"kvarn-{match[1].lower()} requirement: add the pin or remove {const}"
            )
    return problems


def _with_bound(low: str, high: str, is_min: bool, value: str) -> str:
    return f">={value},<{high}" if is_min else f">={low},<{value}"


def _fmt_pins(pins: Mapping[str, SpecifierSet]) -> str:
    return ", ".join(f"'kvarn-{s}{spec}'" for s, spec in pins.items())


def _compat_lines(pins: Mapping[str, SpecifierSet]) -> list[str]:
    lines = []
    for short, spec in pins.items():
        low, high, _ = split_range(spec)
        lines += [f'{short.upper()}_MIN = "{low}"', f'{short.upper()}_MAX = "{high}"']
    if "formats" in pins:
        lines.append("FORMAT_API_MIN = <int>")
    return lines


# --------------------------------------------------------------------------- release


def check_tag_free(root: Path, pkg: Package, tags: Sequence[str] | None = None) -> list[str]:
    tags = list_tags(root) if tags is None else tags
    if pkg.tag in tags:
        return [
            f"{pkg.name}: tag {pkg.tag} already exists, so {pkg.version} is released: bump "
            f"version in {pkg.rel}/pyproject.toml and add its CHANGELOG.md entry"
        ]
    return []


def release_problems(
    root: Path, short: str, *, releasing: bool = False, tags: Sequence[str] | None = None
) -> list[str]:
    """Everything that blocks a release of `kvarn-<short>` from the working tree at `root`."""
    tree = WorkTree(root)
    try:
        pkg = read_package(tree, short)
    except RepoError as exc:
        return [str(exc)]
    if pkg is None:
        return [f"kvarn-{short}: packages/kvarn-{short}/pyproject.toml does not exist"]
    problems = check_changelog(tree, pkg) + check_pins(tree, pkg)
    if releasing:
        problems += check_tag_free(root, pkg, tags)
    return problems


# --------------------------------------------------------------------------- skew


@dataclass(frozen=True)
class Pick:
    """One package at one version, from a release tag or from the working tree."""

    short: str
    version: str
    tag: str | None  # None: the working tree

    @property
    def name(self) -> str:
        return f"kvarn-{self.short}"

    def describe(self) -> str:
        return f"{self.name} {self.version} ({self.tag or 'working tree'})"


@dataclass
class SkewRun:
    """One install to test: `consumer` with exactly these `providers`."""

    kind: str  # "oldest" or "forward"
    consumer: Pick
    providers: list[Pick] = field(default_factory=list)  # bottom-up
    problems: list[str] = field(default_factory=list)  # fail before installing anything
    skip: str | None = None  # a combination no user can get: said, not tested

    def title(self) -> str:
        deps = ", ".join(p.describe() for p in self.providers)
        return f"[{self.kind}] {self.consumer.describe()} with {deps}"


def _tree_for(root: Path, work: WorkTree, pick: Pick) -> Tree:
    return work if pick.tag is None else GitTree(root, pick.tag)


def _candidates(
    short: str, tree_pkg: Package | None, tags: Sequence[str]
) -> dict[Version, str | None]:
    found: dict[Version, str | None] = {}
    if tree_pkg is not None:
        found[Version(tree_pkg.version)] = None
    found.update(released_versions(tags, short))  # a tag wins over the same tree version
    return found


def _api_problems(
    consumer_label: str,
    compat: Mapping[str, object] | None,
    formats: Pick,
    formats_api: int | None,
    candidates: Mapping[Version, int | None],
) -> list[str]:
    if compat is None or "FORMAT_API_MIN" not in compat:
        return []
    need = compat["FORMAT_API_MIN"]
    if not isinstance(need, int):
        return []
    if formats_api is None:
        return [
            f"{formats.describe()}: no module-level FORMAT_API = <int> found in its "
            "src/kvarn_formats: define it (consumers check it at import)"
        ]
    if formats_api >= need:
        return []
    good = sorted(v for v, api in candidates.items() if api is not None and api >= need)
    fix = (
        f'raise the pin to kvarn-formats>={good[0]} (and FORMATS_MIN = "{good[0]}" in _compat.py)'
        if good
        else f"release a kvarn-formats with FORMAT_API >= {need} and raise the pin to it"
    )
    return [
        f"{consumer_label} needs FORMAT_API >= {need} (FORMAT_API_MIN in _compat.py) but "
        f"{formats.describe()}, the oldest kvarn-formats its pin admits, has FORMAT_API "
        f"{formats_api}: kvarn-formats too old for the pin; {fix}"
    ]


def plan_oldest(
    root: Path, packages: Mapping[str, Package], tags: Sequence[str], consumer: Package
) -> SkewRun:
    """The consumer from the working tree with the oldest providers its pins admit."""
    work = WorkTree(root)
    run = SkewRun("oldest", Pick(consumer.short, consumer.version, None))
    run.problems += check_pins(work, consumer)
    constraints: dict[str, list[tuple[str, SpecifierSet]]] = {}
    for short, spec in consumer.sibling_pins().items():
        constraints.setdefault(short, []).append((f"{consumer.name} {consumer.version}", spec))
    chosen: dict[str, tuple[Pick, Package, Tree]] = {}
    # Highest layer first: a provider's own pins only point further down.
    while True:
        todo = [s for s in constraints if s not in chosen]
        if not todo:
            break
        short = max(todo, key=lambda s: (LAYERS.index(s) if s in LAYERS else -1, s))
        cands = _candidates(short, packages.get(short), tags)
        admitted = sorted(v for v in cands if all(v in spec for _, spec in constraints[short]))
        wants = "; ".join(f"{who} pins kvarn-{short}{spec}" for who, spec in constraints[short])
        if not admitted:
            known = (
                ", ".join(f"{v} ({cands[v] or 'working tree'})" for v in sorted(cands)) or "none"
            )
            run.problems.append(
                f"no kvarn-{short} satisfies the pins ({wants}); known versions: {known}: "
                f"kvarn-{short} is too old (or too new) for the pin: change the pin and the "
                f"{short.upper()}_MIN/{short.upper()}_MAX in _compat.py, or release a "
                f"kvarn-{short} inside it first"
            )
            chosen[short] = (Pick(short, "?", None), packages.get(short) or consumer, work)
            continue
        version = admitted[0]
        pick = Pick(short, str(version), cands[version])
        tree = _tree_for(root, work, pick)
        pkg = read_package(tree, short)
        if pkg is None:
            run.problems.append(f"{pick.describe()}: no pyproject.toml in that tree")
            chosen[short] = (pick, consumer, tree)
            continue
        chosen[short] = (pick, pkg, tree)
        for sub, spec in pkg.sibling_pins().items():
            constraints.setdefault(sub, []).append((f"{pkg.name} {pkg.version}", spec))
    run.providers = [
        chosen[s][0] for s in sorted(chosen, key=lambda s: LAYERS.index(s) if s in LAYERS else 99)
    ]
    if "formats" in chosen and chosen["formats"][0].version != "?":
        fpick, fpkg, ftree = chosen["formats"]
        api = find_format_api(ftree, fpkg)
        apis = _format_api_by_version(root, work, packages, tags)
        users = [(consumer.name, read_compat(work, consumer))]
        users += [(p.name, read_compat(t, p)) for s, (_, p, t) in chosen.items() if s != "formats"]
        for label, compat in users:
            run.problems += _api_problems(label, compat, fpick, api, apis)
    return run


def _format_api_by_version(
    root: Path, work: WorkTree, packages: Mapping[str, Package], tags: Sequence[str]
) -> dict[Version, int | None]:
    apis: dict[Version, int | None] = {}
    for version, tag in _candidates("formats", packages.get("formats"), tags).items():
        tree: Tree = work if tag is None else GitTree(root, tag)
        pkg = read_package(tree, "formats")
        apis[version] = None if pkg is None else find_format_api(tree, pkg)
    return apis


def plan_forward(
    root: Path, packages: Mapping[str, Package], tags: Sequence[str], consumer: Package
) -> SkewRun | None:
    """The consumer's last release tag with the providers of the working tree."""
    released = released_versions(tags, consumer.short)
    if not released:
        return None
    last = max(released)
    tag = released[last]
    tagged = read_package(GitTree(root, tag), consumer.short)
    run = SkewRun("forward", Pick(consumer.short, str(last), tag))
    if tagged is None:
        run.problems.append(f"tag {tag} has no packages/{consumer.name}/pyproject.toml")
        return run
    work = WorkTree(root)
    # What the tagged release requires, and what those providers (from the tree) require.
    graph = runtime_graph(packages)
    graph[consumer.short] = {s for s in tagged.sibling_pins() if s in packages}
    needed = providers_closure(graph, consumer.short)
    pins = tagged.sibling_pins()
    for short in needed:  # transitive providers come from the tree too
        tree_pkg = packages[short]
        run.providers.append(Pick(short, tree_pkg.version, None))
        if short in pins and Version(tree_pkg.version) not in pins[short]:
            run.skip = (
                f"{tree_pkg.name} {tree_pkg.version} in the working tree is outside the pin "
                f"kvarn-{short}{pins[short]} of {tagged.name} {tagged.version}: no user of that "
                "release can install this pair"
            )
    if run.skip is None and "formats" in [p.short for p in run.providers]:
        fpick = next(p for p in run.providers if p.short == "formats")
        api = find_format_api(work, packages["formats"])
        run.problems += _api_problems(
            f"{tagged.name} {tagged.version} ({tag})",
            read_compat(GitTree(root, tag), tagged),
            fpick,
            api,
            {},
        )
    return run


def plan_skew(root: Path, tags: Sequence[str] | None = None) -> list[SkewRun]:
    """Every skew run for the packages in the working tree at `root`."""
    tags = list_tags(root) if tags is None else tags
    packages = discover(WorkTree(root))
    graph = runtime_graph(packages)
    runs: list[SkewRun] = []
    for short, pkg in packages.items():
        if not graph.get(short):
            continue
        runs.append(plan_oldest(root, packages, tags, pkg))
        forward = plan_forward(root, packages, tags, pkg)
        if forward is not None:
            runs.append(forward)
    return runs


# --------------------------------------------------------------------------- command line


def _normalize(name: str) -> str:
    return name.removeprefix("kvarn-").removeprefix("kvarn_")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--root", type=Path, default=Path(__file__).resolve().parent.parent)
    sub = parser.add_subparsers(dest="cmd", required=True)
    p_check = sub.add_parser("check", help="changelog and pin checks")
    p_check.add_argument("packages", nargs="*")
    p_check.add_argument("--all", action="store_true")
    p_check.add_argument("--release", action="store_true", help="also: the tag must not exist")
    sub.add_parser("skew", help="print the skew plan and its problems")
    p_changed = sub.add_parser("changed", help="packages to test for a git range")
    p_changed.add_argument("range")
    args = parser.parse_args(argv)
    root: Path = args.root

    try:
        if args.cmd == "check":
            names = [_normalize(n) for n in args.packages]
            if args.all:
                names = list(discover(WorkTree(root)))
            if not names:
                parser.error("name a package (kvarn-formats, ...) or pass --all")
            problems = []
            for short in names:
                problems += release_problems(root, short, releasing=args.release)
            for line in problems:
                print(line)
            if not problems:
                print(f"release checks passed: {', '.join('kvarn-' + n for n in names)}")
            return 1 if problems else 0
        if args.cmd == "skew":
            failed = False
            for run in plan_skew(root):
                print(run.title())
                for line in run.problems:
                    print(f"  PROBLEM: {line}")
                    failed = True
                if run.skip:
                    print(f"  not tested: {run.skip}")
            return 1 if failed else 0
        if args.cmd == "changed":
            packages = discover(WorkTree(root))
            selected, root_tests = packages_for_changes(changed_files(root, args.range), packages)
            print(" ".join(s for s in packages if s in selected) or "(no package)")
            if root_tests:
                print("integration")
            return 0
    except RepoError as exc:
        print(exc)
        return 1
    return 2


if __name__ == "__main__":
    raise SystemExit(main())
