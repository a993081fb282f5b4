"""Static checks of what a plugin expects from vLLM's Python API, against vLLM's source.

Nothing here imports vLLM: every check reads the source with :mod:`ast`, so the API of a vLLM
build that cannot run on this machine (vLLM 0.33 needs a CUDA torch) can still be checked.

An expectation says one thing the plugin relies on (a module, a name in it, a class member, an
enum member, a dataclass field, a signature the plugin overrides or calls, a call vLLM makes
into the plugin). :func:`check` runs a list of them over a source tree and returns the failures,
each naming the expectation and what differs. :func:`fetch_vllm_source` downloads a vLLM wheel
with pip and keeps its ``.py`` files in a per-version cache directory.
"""

from __future__ import annotations

import ast
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

# --------------------------------------------------------------------------- source tree


@dataclass
class Module:
    """One parsed module of the tree."""

    name: str
    path: Path
    tree: ast.Module
    is_package: bool


@dataclass
class Definition:
    """Where a name resolves: a class, function, assignment, module, or outside the tree."""

    kind: str  # "class" | "function" | "assign" | "module" | "external"
    module: str
    node: ast.AST | None = None


def _is_type_checking(test: ast.expr) -> bool:
    text = ast.unparse(test)
    return text in ("TYPE_CHECKING", "typing.TYPE_CHECKING")


def _runtime_statements(body: Sequence[ast.stmt]) -> Iterator[ast.stmt]:
    """Statements that run when the body runs (both arms of if/try; not TYPE_CHECKING)."""
    for stmt in body:
        if isinstance(stmt, ast.If):
            if not _is_type_checking(stmt.test):
                yield from _runtime_statements(stmt.body)
            yield from _runtime_statements(stmt.orelse)
        elif isinstance(stmt, ast.Try):
            yield from _runtime_statements(stmt.body)
            for handler in stmt.handlers:
                yield from _runtime_statements(handler.body)
            yield from _runtime_statements(stmt.orelse)
            yield from _runtime_statements(stmt.finalbody)
        elif isinstance(stmt, ast.With):
            yield from _runtime_statements(stmt.body)
        else:
            yield stmt


def _target_names(stmt: ast.stmt) -> list[str]:
    if isinstance(stmt, ast.Assign):
        return [t.id for t in stmt.targets if isinstance(t, ast.Name)]
    if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
        return [stmt.target.id]
    return []


class SourceTree:
    """The ``vllm`` package under a directory, parsed on demand.

    ``root`` is the directory holding ``vllm/`` (site-packages, an unpacked wheel) or the
    ``vllm`` package directory itself.
    """

    def __init__(self, root: str | os.PathLike[str]) -> None:
        path = Path(root)
        if (path / "vllm" / "__init__.py").is_file():
            self.root = path
        elif path.name == "vllm" and (path / "__init__.py").is_file():
            self.root = path.parent
        else:
            raise ValueError(f"{path}: no vllm package (vllm/__init__.py) there")
        self._modules: dict[str, Module | None] = {}
        self._index: dict[str, list[str]] | None = None

    # modules -------------------------------------------------------------

    def module_path(self, dotted: str) -> tuple[Path, bool] | None:
        base = self.root.joinpath(*dotted.split("."))
        if (base / "__init__.py").is_file():
            return base / "__init__.py", True
        if base.with_suffix(".py").is_file():
            return base.with_suffix(".py"), False
        return None

    def module(self, dotted: str) -> Module | None:
        if dotted not in self._modules:
            found = self.module_path(dotted)
            if found is None:
                self._modules[dotted] = None
            else:
                path, is_package = found
                tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
                self._modules[dotted] = Module(dotted, path, tree, is_package)
        return self._modules[dotted]

    def in_tree(self, dotted: str) -> bool:
        return dotted.split(".")[0] == "vllm"

    def _absolute(self, mod: Module, node: ast.ImportFrom) -> str:
        if not node.level:
            return node.module or ""
        parts = mod.name.split(".")
        keep = len(parts) - node.level + (1 if mod.is_package else 0)
        base = ".".join(parts[:keep])
        return f"{base}.{node.module}" if node.module else base

    # names ---------------------------------------------------------------

    def find(
        self, dotted: str, name: str, _seen: frozenset[str] = frozenset()
    ) -> Definition | None:
        """Where ``name`` in module ``dotted`` comes from at run time, or None."""
        key = f"{dotted}:{name}"
        if key in _seen:
            return None
        seen = _seen | {key}
        mod = self.module(dotted)
        if mod is None:
            return None
        found: Definition | None = None
        stars: list[str] = []
        for stmt in _runtime_statements(mod.tree.body):
            if isinstance(stmt, ast.ClassDef) and stmt.name == name:
                found = Definition("class", dotted, stmt)
            elif isinstance(stmt, ast.FunctionDef | ast.AsyncFunctionDef) and stmt.name == name:
                found = Definition("function", dotted, stmt)
            elif name in _target_names(stmt):
                found = Definition("assign", dotted, stmt)
            elif isinstance(stmt, ast.ImportFrom):
                source = self._absolute(mod, stmt)
                for alias in stmt.names:
                    if alias.name == "*":
                        stars.append(source)
                    elif (alias.asname or alias.name) == name:
                        found = self._follow(source, alias.name, seen) or found
            elif isinstance(stmt, ast.Import):
                for alias in stmt.names:
                    bound = alias.asname or alias.name.split(".")[0]
                    if bound == name:
                        target = alias.name if alias.asname else alias.name.split(".")[0]
                        kind = "module" if self.in_tree(target) else "external"
                        found = Definition(kind, target)
        if found is None:
            for source in stars:
                found = self._follow(source, name, seen)
                if found is not None:
                    break
        return found

    def _follow(self, source: str, name: str, seen: frozenset[str]) -> Definition | None:
        # Outside vllm, or a compiled module of it (vllm._C): taken as given.
        if not self.in_tree(source) or self.module(source) is None:
            return Definition("external", source)
        target = self.find(source, name, seen)
        if target is not None:
            return target
        if self.module(f"{source}.{name}") is not None:
            return Definition("module", f"{source}.{name}")
        return None  # the import itself would fail

    def locate(self, name: str, limit: int = 3) -> list[str]:
        """Modules that define ``name`` at top level (a hint for a failure message)."""
        if self._index is None:
            self._index = {}
            pattern = re.compile(r"^(?:(?:async\s+)?def\s+(\w+)|class\s+(\w+)|(\w+)\s*[:=])", re.M)
            for path in sorted((self.root / "vllm").rglob("*.py")):
                try:
                    text = path.read_text(encoding="utf-8")
                except (OSError, UnicodeDecodeError):
                    continue
                rel = path.relative_to(self.root).with_suffix("")
                dotted = ".".join(rel.parts[:-1] if rel.name == "__init__" else rel.parts)
                for match in pattern.finditer(text):
                    found = next(g for g in match.groups() if g)
                    where = self._index.setdefault(found, [])
                    if dotted not in where:
                        where.append(dotted)
        return self._index.get(name, [])[:limit]

    # classes -------------------------------------------------------------

    def find_class(self, dotted: str, name: str) -> tuple[str, ast.ClassDef] | None:
        found = self.find(dotted, name)
        if found is None or found.kind != "class":
            return None
        assert isinstance(found.node, ast.ClassDef)
        return found.module, found.node

    def class_chain(self, dotted: str, node: ast.ClassDef) -> list[tuple[str, ast.ClassDef]]:
        """The class and its bases defined in the tree, nearest first (a simple MRO)."""
        chain: list[tuple[str, ast.ClassDef]] = []
        todo = [(dotted, node)]
        while todo:
            mod, cls = todo.pop(0)
            if any(c is cls for _, c in chain):
                continue
            chain.append((mod, cls))
            for base in cls.bases:
                expr = base.value if isinstance(base, ast.Subscript) else base
                if isinstance(expr, ast.Name):
                    found = self.find_class(mod, expr.id)
                    if found is not None:
                        todo.append(found)
        return chain

    def base_names(self, node: ast.ClassDef) -> list[str]:
        names = []
        for base in node.bases:
            expr = base.value if isinstance(base, ast.Subscript) else base
            names.append(ast.unparse(expr).split(".")[-1])
        return names

    def members(self, dotted: str, node: ast.ClassDef) -> dict[str, Member]:
        """Every member of a class and of its in-tree bases (the nearest definition wins)."""
        out: dict[str, Member] = {}
        for mod, cls in reversed(self.class_chain(dotted, node)):
            for stmt in _runtime_statements(cls.body):
                for member in _members_of(stmt, mod, cls.name):
                    out[member.name] = member
                if isinstance(stmt, ast.FunctionDef) and stmt.name == "__init__":
                    for sub in ast.walk(stmt):
                        for name in _self_targets(sub):
                            if name not in out or out[name].kind == "instance":
                                out[name] = Member(name, "instance", f"{mod}:{cls.name}", sub)
        return out


@dataclass
class Member:
    name: str
    kind: str  # method staticmethod classmethod property attribute field classvar instance
    owner: str  # "module:Class"
    node: ast.stmt

    @property
    def is_field(self) -> bool:
        return self.kind == "field"


def _self_targets(node: ast.AST) -> list[str]:
    """``x`` of ``self.x = ...`` / ``self.x: T = ...``."""
    if isinstance(node, ast.Assign):
        targets = node.targets
    elif isinstance(node, ast.AnnAssign):
        targets = [node.target]
    else:
        return []
    return [
        t.attr
        for t in targets
        if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self"
    ]


def _decorator_kind(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> str:
    kind = "method"
    for deco in fn.decorator_list:
        text = ast.unparse(deco)
        if text == "staticmethod":
            kind = "staticmethod"
        elif text == "classmethod":
            kind = "classmethod"
        elif text in ("property", "cached_property", "functools.cached_property") or (
            text.endswith((".setter", ".getter", ".deleter"))
        ):
            kind = "property"
    return kind


def _members_of(stmt: ast.stmt, mod: str, cls: str) -> list[Member]:
    owner = f"{mod}:{cls}"
    if isinstance(stmt, ast.FunctionDef | ast.AsyncFunctionDef):
        return [Member(stmt.name, _decorator_kind(stmt), owner, stmt)]
    if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
        annotation = ast.unparse(stmt.annotation)
        kind = "classvar" if re.match(r"^(typing\.)?ClassVar\b", annotation) else "field"
        return [Member(stmt.target.id, kind, owner, stmt)]
    return [Member(n, "attribute", owner, stmt) for n in _target_names(stmt)]


# --------------------------------------------------------------------------- signatures


@dataclass(frozen=True)
class Sig:
    """A function's parameters, as far as calls are concerned."""

    positional: tuple[str, ...]
    kwonly: tuple[str, ...] = ()
    defaults: frozenset[str] = frozenset()
    varargs: str | None = None
    varkw: str | None = None

    @classmethod
    def of(cls, fn: ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda) -> Sig:
        a = fn.args
        positional = tuple(p.arg for p in [*a.posonlyargs, *a.args])
        with_default = set(positional[len(positional) - len(a.defaults) :]) if a.defaults else set()
        for p, d in zip(a.kwonlyargs, a.kw_defaults, strict=True):
            if d is not None:
                with_default.add(p.arg)
        return cls(
            positional=positional,
            kwonly=tuple(p.arg for p in a.kwonlyargs),
            defaults=frozenset(with_default),
            varargs=a.vararg.arg if a.vararg else None,
            varkw=a.kwarg.arg if a.kwarg else None,
        )

    @classmethod
    def parse(cls, text: str) -> Sig:
        """``"(self, a, b=None, **kw)"`` -> Sig (defaults' values are not kept)."""
        fn = ast.parse(f"def _f{text}: pass").body[0]
        assert isinstance(fn, ast.FunctionDef)
        return cls.of(fn)

    def drop_first(self) -> Sig:
        """The signature as seen through an instance or class (``self``/``cls`` bound)."""
        first = self.positional[:1]
        return Sig(
            self.positional[1:], self.kwonly, self.defaults - set(first), self.varargs, self.varkw
        )

    def required(self) -> list[str]:
        return [p for p in (*self.positional, *self.kwonly) if p not in self.defaults]

    def accepts_name(self, name: str) -> bool:
        return name in self.positional or name in self.kwonly or self.varkw is not None

    def __str__(self) -> str:
        parts = [p + ("=…" if p in self.defaults else "") for p in self.positional]
        if self.varargs:
            parts.append(f"*{self.varargs}")
        elif self.kwonly:
            parts.append("*")
        parts += [p + ("=…" if p in self.defaults else "") for p in self.kwonly]
        if self.varkw:
            parts.append(f"**{self.varkw}")
        return f"({', '.join(parts)})"


@dataclass(frozen=True)
class CallShape:
    """What a call passes: how many positional arguments, which keywords, any * or **."""

    positional: int
    keywords: tuple[str, ...] = ()
    star_args: bool = False
    star_kwargs: tuple[str, ...] = ()  # the expressions after **

    @classmethod
    def of(cls, call: ast.Call) -> CallShape:
        return cls(
            positional=sum(not isinstance(a, ast.Starred) for a in call.args),
            keywords=tuple(k.arg for k in call.keywords if k.arg is not None),
            star_args=any(isinstance(a, ast.Starred) for a in call.args),
            star_kwargs=tuple(ast.unparse(k.value) for k in call.keywords if k.arg is None),
        )

    @classmethod
    def parse(cls, text: str) -> CallShape:
        """``"f(a, b, c=1)"`` -> CallShape."""
        expr = ast.parse(text, mode="eval").body
        assert isinstance(expr, ast.Call), text
        return cls.of(expr)


def bind_problems(sig: Sig, call: CallShape, *, assume_star_kwargs_fit: bool = False) -> list[str]:
    """Why ``call`` cannot bind to ``sig`` (``self``/``cls`` already dropped); [] when it can."""
    problems = []
    if call.positional > len(sig.positional) and sig.varargs is None:
        problems.append(
            f"passes {call.positional} positional arguments, {sig} takes {len(sig.positional)}"
        )
    given = set(sig.positional[: call.positional])
    for kw in call.keywords:
        if kw in given:
            problems.append(f"passes {kw!r} both by position and by keyword to {sig}")
        elif not sig.accepts_name(kw):
            problems.append(f"passes keyword {kw!r}, which {sig} does not accept")
        given.add(kw)
    if call.star_kwargs and sig.varkw is None and not assume_star_kwargs_fit:
        problems.append(
            f"passes **{', **'.join(call.star_kwargs)}, and {sig} takes no **kwargs (names "
            "unknown statically)"
        )
    if not (call.star_args or call.star_kwargs):
        missing = [p for p in sig.required() if p not in given]
        if missing:
            problems.append(f"does not pass {', '.join(missing)}, which {sig} requires")
    return problems


def override_problems(base: Sig, plugin: Sig) -> list[str]:
    """Why ``plugin`` cannot stand in for ``base`` for callers of ``base`` ([] when it can).

    Both signatures are as seen through the instance/class (``self``/``cls`` dropped). A base
    parameter past the plugin's positional ones must be taken by the plugin's ``**kwargs``
    (vLLM then has to pass it by keyword: pair this with a call-site check).
    """
    problems = []
    lacking, now_required = [], []
    for i, name in enumerate(base.positional):
        if i < len(plugin.positional):
            if plugin.positional[i] != name:
                problems.append(
                    f"parameter {i + 1} is {name!r} in vLLM, {plugin.positional[i]!r} in the plugin"
                )
            elif name in base.defaults and name not in plugin.defaults:
                now_required.append(name)
        elif name in plugin.kwonly:
            problems.append(f"{name!r} is positional in vLLM, keyword-only in the plugin")
        elif plugin.varkw is None and plugin.varargs is None:
            lacking.append(name)
    for name in base.kwonly:
        if not plugin.accepts_name(name):
            lacking.append(name)
        elif name in base.defaults and name in plugin.required():
            now_required.append(name)
    if lacking:
        problems.append(f"vLLM passes {', '.join(lacking)}, which the plugin does not take")
    if now_required:
        problems.append(
            f"vLLM may omit {', '.join(now_required)} (defaults there), the plugin requires them"
        )
    if base.varargs and not plugin.varargs:
        problems.append(f"vLLM takes *{base.varargs}, the plugin does not")
    if base.varkw and not plugin.varkw:
        problems.append(f"vLLM takes **{base.varkw}, the plugin does not")
    base_names = set(base.positional) | set(base.kwonly)
    extra = [n for n in plugin.required() if n not in base_names]
    if extra:
        problems.append(f"the plugin requires {', '.join(extra)}, which vLLM never passes")
    if problems:
        problems = [f"{p} (vLLM {base}, plugin {plugin})" for p in problems]
    return problems


def _kind_drops_first(kind: str) -> bool:
    return kind in ("method", "classmethod", "property")


def _find_function(
    tree: SourceTree, module: str, qualname: str
) -> tuple[ast.FunctionDef | ast.AsyncFunctionDef, str] | str:
    """(function node, kind) for ``Class.method`` or ``function`` in a module, or a reason."""
    head, _, rest = qualname.partition(".")
    if tree.module(module) is None or tree.find(module, head) is None:
        where = tree.locate(head)
        hint = f"; {head} is defined in {', '.join(where)}" if where else ""
        if tree.module(module) is None:
            return f"module {module} does not exist{hint}"
        return f"{module} has no {head}{hint}"
    found = tree.find(module, head)
    assert found is not None
    if not rest:
        if found.kind != "function":
            return f"{module}.{head} is a {found.kind}, not a function"
        assert isinstance(found.node, ast.FunctionDef | ast.AsyncFunctionDef)
        return found.node, "function"
    if found.kind != "class":
        return f"{module}.{head} is a {found.kind}, not a class"
    assert isinstance(found.node, ast.ClassDef)
    members = tree.members(found.module, found.node)
    member = members.get(rest)
    if member is None or not isinstance(member.node, ast.FunctionDef | ast.AsyncFunctionDef):
        return f"{module}.{head} (and its vLLM bases) has no method {rest}"
    return member.node, member.kind


# --------------------------------------------------------------------------- expectations


@dataclass(frozen=True)
class Failure:
    expectation: str
    message: str

    def __str__(self) -> str:
        return f"{self.expectation}: {self.message}"


@dataclass(frozen=True, kw_only=True)
class Expectation:
    """One thing the plugin relies on. ``id`` names it in failures; ``why`` says where the
    plugin uses it; ``plugin_ref`` (``module:Class.method``) names the plugin's own function
    whose signature the expectation records, if any; ``versions`` are the vLLM release series
    ("0.32", "0.33") it applies to."""

    id: str
    why: str = ""
    plugin_ref: str = ""  # "kvarn_vllm.backend:KvarnAttentionBackend.customize_spec"
    versions: frozenset[str] = field(default_factory=lambda: frozenset({"0.32", "0.33"}))

    def problems(self, tree: SourceTree) -> list[str]:
        raise NotImplementedError

    def describe(self) -> str:
        raise NotImplementedError

    def _module_missing(self, tree: SourceTree, module: str, name: str | None = None) -> str:
        msg = f"module {module} does not exist"
        if name:
            where = tree.locate(name)
            if where:
                msg += f"; {name} is defined in {', '.join(where)}"
        return msg

    def _class(self, tree: SourceTree, module: str, cls: str) -> tuple[str, ast.ClassDef] | str:
        if tree.module(module) is None:
            return self._module_missing(tree, module, cls)
        found = tree.find(module, cls)
        if found is None:
            where = tree.locate(cls)
            hint = f" (defined in {', '.join(where)})" if where else ""
            return f"{module} has no {cls}{hint}"
        if found.kind != "class":
            return f"{module}.{cls} is a {found.kind}, not a class"
        assert isinstance(found.node, ast.ClassDef)
        return found.module, found.node


@dataclass(frozen=True, kw_only=True)
class Symbols(Expectation):
    """``from <module> import <names>`` works (the module exists and defines each name)."""

    module: str
    names: tuple[str, ...] = ()
    kinds: dict[str, str] = field(default_factory=dict)  # name -> "class" | "function" | ...

    def problems(self, tree: SourceTree) -> list[str]:
        if tree.module(self.module) is None:
            return [self._module_missing(tree, self.module, self.names[0] if self.names else None)]
        out = []
        for name in self.names:
            found = tree.find(self.module, name)
            if found is None:
                where = tree.locate(name)
                hint = f" (defined in {', '.join(where)})" if where else ""
                out.append(f"{self.module} has no {name}{hint}")
            elif name in self.kinds and found.kind != self.kinds[name]:
                out.append(f"{self.module}.{name} is a {found.kind}, not a {self.kinds[name]}")
        return out

    def describe(self) -> str:
        if not self.names:
            return f"module {self.module} exists"
        return f"from {self.module} import {', '.join(self.names)}"


@dataclass(frozen=True, kw_only=True)
class Members(Expectation):
    """A class (or its vLLM bases) has these members; ``kinds`` pins a member's kind
    (method, staticmethod, classmethod, property, attribute, field, classvar)."""

    module: str
    cls: str
    names: tuple[str, ...]
    kinds: dict[str, str] = field(default_factory=dict)

    def problems(self, tree: SourceTree) -> list[str]:
        found = self._class(tree, self.module, self.cls)
        if isinstance(found, str):
            return [found]
        members = tree.members(*found)
        out = []
        for name in self.names:
            member = members.get(name)
            if member is None:
                out.append(f"{self.module}.{self.cls} (and its vLLM bases) has no {name}")
            elif name in self.kinds and member.kind != self.kinds[name]:
                out.append(
                    f"{self.module}.{self.cls}.{name} is a {member.kind}, not a {self.kinds[name]}"
                )
        return out

    def describe(self) -> str:
        return f"{self.module}.{self.cls} has {', '.join(self.names)}"


@dataclass(frozen=True, kw_only=True)
class Fields(Members):
    """A dataclass / NamedTuple (or its vLLM bases) declares these fields (annotated names)."""

    def problems(self, tree: SourceTree) -> list[str]:
        found = self._class(tree, self.module, self.cls)
        if isinstance(found, str):
            return [found]
        members = tree.members(*found)
        out = []
        for name in self.names:
            member = members.get(name)
            if member is None:
                out.append(f"{self.module}.{self.cls} (and its vLLM bases) has no field {name}")
            elif not member.is_field:
                out.append(f"{self.module}.{self.cls}.{name} is a {member.kind}, not a field")
        return out

    def describe(self) -> str:
        return f"{self.module}.{self.cls} fields {', '.join(self.names)}"


@dataclass(frozen=True, kw_only=True)
class HasBase(Expectation):
    """A class lists ``base`` among its bases (its own or an in-tree base class's), e.g.
    NamedTuple, for ``_asdict()``."""

    module: str
    cls: str
    base: str

    def problems(self, tree: SourceTree) -> list[str]:
        found = self._class(tree, self.module, self.cls)
        if isinstance(found, str):
            return [found]
        bases = [b for _, c in tree.class_chain(*found) for b in tree.base_names(c)]
        if self.base not in bases:
            return [f"{self.module}.{self.cls} does not derive from {self.base} (bases: {bases})"]
        return []

    def describe(self) -> str:
        return f"{self.module}.{self.cls} derives from {self.base}"


@dataclass(frozen=True, kw_only=True)
class EnumMembers(Expectation):
    """An enum class has these members, each with a value no other member has (an ``Enum``
    member whose value repeats another's is only an alias of it)."""

    module: str
    cls: str
    names: tuple[str, ...]
    unique: bool = True

    def problems(self, tree: SourceTree) -> list[str]:
        found = self._class(tree, self.module, self.cls)
        if isinstance(found, str):
            return [found]
        _, node = found
        values: dict[str, str] = {}
        for stmt in _runtime_statements(node.body):
            if isinstance(stmt, ast.Assign) and stmt.value is not None:
                for name in _target_names(stmt):
                    if not name.startswith("_"):
                        values[name] = ast.dump(stmt.value)
        out = []
        for name in self.names:
            if name not in values:
                present = ", ".join(values) or "none"
                out.append(f"{self.module}.{self.cls} has no member {name} (members: {present})")
                continue
            if not self.unique or "Call(func=Name(id='auto'" in values[name]:
                continue
            first = next(n for n, v in values.items() if v == values[name])
            if first != name:
                out.append(
                    f"{self.module}.{self.cls}.{name} has the value of {first}, so it is an alias: "
                    f"{self.cls}.{name} is {self.cls}.{first}"
                )
        return out

    def describe(self) -> str:
        return f"enum {self.module}.{self.cls}.{{{', '.join(self.names)}}}"


@dataclass(frozen=True, kw_only=True)
class KnownFields(Expectation):
    """Every field of a NamedTuple / dataclass (with its vLLM bases) is one the plugin knows."""

    module: str
    cls: str
    known: tuple[str, ...]

    def problems(self, tree: SourceTree) -> list[str]:
        found = self._class(tree, self.module, self.cls)
        if isinstance(found, str):
            return [found]
        fields = [m.name for m in tree.members(*found).values() if m.is_field]
        unknown = [f for f in fields if f not in self.known]
        if unknown:
            return [f"{self.module}.{self.cls} has fields the plugin does not know: {unknown}"]
        return []

    def describe(self) -> str:
        return f"every field of {self.module}.{self.cls} is known to the plugin"


@dataclass(frozen=True, kw_only=True)
class AnnotationAccepts(Expectation):
    """A dataclass field's annotation admits a type (e.g. ``CacheDType | str`` admits str)."""

    module: str
    cls: str
    name: str
    type_name: str

    def problems(self, tree: SourceTree) -> list[str]:
        found = self._class(tree, self.module, self.cls)
        if isinstance(found, str):
            return [found]
        member = tree.members(*found).get(self.name)
        if member is None or not isinstance(member.node, ast.AnnAssign):
            return [f"{self.module}.{self.cls} has no annotated field {self.name}"]
        annotation = member.node.annotation
        names = {
            n.id if isinstance(n, ast.Name) else n.value
            for n in ast.walk(annotation)
            if isinstance(n, ast.Name) or (isinstance(n, ast.Constant) and isinstance(n.value, str))
        }
        if self.type_name not in names:
            return [
                f"{self.module}.{self.cls}.{self.name}: {ast.unparse(annotation)} does not admit "
                f"{self.type_name}"
            ]
        return []

    def describe(self) -> str:
        return f"{self.module}.{self.cls}.{self.name} admits {self.type_name}"


@dataclass(frozen=True, kw_only=True)
class Constant(Expectation):
    """A module-level constant has this literal value."""

    module: str
    name: str
    value: object

    def problems(self, tree: SourceTree) -> list[str]:
        if tree.module(self.module) is None:
            return [self._module_missing(tree, self.module)]
        found = tree.find(self.module, self.name)
        if found is None or found.kind != "assign":
            return [f"{self.module} has no constant {self.name}"]
        assert isinstance(found.node, ast.Assign | ast.AnnAssign) and found.node.value is not None
        try:
            value = ast.literal_eval(found.node.value)
        except ValueError:
            return [f"{self.module}.{self.name} is not a literal: {ast.unparse(found.node.value)}"]
        if value != self.value:
            return [f"{self.module}.{self.name} is {value!r}, not {self.value!r}"]
        return []

    def describe(self) -> str:
        return f"{self.module}.{self.name} == {self.value!r}"


@dataclass(frozen=True, kw_only=True)
class Accepts(Expectation):
    """The plugin calls a vLLM function or method like ``call`` (e.g. ``"f(a, b, c=1)"``)."""

    module: str
    qualname: str
    call: str

    def problems(self, tree: SourceTree) -> list[str]:
        found = _find_function(tree, self.module, self.qualname)
        if isinstance(found, str):
            return [found]
        node, kind = found
        sig = Sig.of(node)
        if _kind_drops_first(kind) or (node.name == "__init__"):
            sig = sig.drop_first()
        return [
            f"{self.module}.{self.qualname}: the plugin's {self.call} " + p
            for p in bind_problems(sig, CallShape.parse(self.call))
        ]

    def describe(self) -> str:
        return f"{self.module}.{self.qualname} accepts {self.call}"


@dataclass(frozen=True, kw_only=True)
class Overrides(Expectation):
    """The plugin overrides a vLLM method with ``plugin`` parameters (``"(cls, spec)"``) and
    the same kind (method / staticmethod / classmethod): every call vLLM may make to the base
    method fits the plugin's."""

    module: str
    cls: str
    method: str
    plugin: str
    kind: str = "method"

    def problems(self, tree: SourceTree) -> list[str]:
        found = _find_function(tree, self.module, f"{self.cls}.{self.method}")
        if isinstance(found, str):
            return [found]
        node, kind = found
        where = f"{self.module}.{self.cls}.{self.method}"
        out = []
        if kind != self.kind:
            out.append(f"{where} is a {kind} in vLLM, the plugin overrides it as a {self.kind}")
        base, plugin = Sig.of(node), Sig.parse(self.plugin)
        if _kind_drops_first(kind):
            base = base.drop_first()
        if _kind_drops_first(self.kind):
            plugin = plugin.drop_first()
        out += [f"{where}: {p}" for p in override_problems(base, plugin)]
        return out

    def describe(self) -> str:
        return f"{self.module}.{self.cls}.{self.method} overridden as {self.kind} {self.plugin}"


@dataclass(frozen=True, kw_only=True)
class CallSite(Expectation):
    """vLLM calls into the plugin: inside ``function`` (``Class.method`` or a function) of
    ``module``, every call whose callee ends with ``callee`` (``"impl.forward"``) binds to the
    plugin's ``plugin`` signature; at least one such call exists. ``star_kwargs_fit`` names
    ``**`` expressions known to be empty for the plugin (with the reason in ``why``)."""

    module: str
    function: str
    callee: str
    plugin: str
    kind: str = "method"
    star_kwargs_fit: tuple[str, ...] = ()

    def problems(self, tree: SourceTree) -> list[str]:
        found = _find_function(tree, self.module, self.function)
        if isinstance(found, str):
            return [found]
        node, _ = found
        sig = Sig.parse(self.plugin)
        if _kind_drops_first(self.kind):
            sig = sig.drop_first()
        calls = []
        for sub in ast.walk(node):
            if isinstance(sub, ast.Call):
                text = ast.unparse(sub.func)
                if text == self.callee or text.endswith("." + self.callee):
                    calls.append(sub)
        where = f"{self.module}.{self.function}"
        if not calls:
            return [f"{where} no longer calls {self.callee}(...)"]
        out = []
        for call in calls:
            shape = CallShape.of(call)
            fits = bool(shape.star_kwargs) and set(shape.star_kwargs) <= set(self.star_kwargs_fit)
            for p in bind_problems(sig, shape, assume_star_kwargs_fit=fits):
                out.append(f"{where} line {call.lineno}: {ast.unparse(call.func)}(...) {p}")
        return out

    def describe(self) -> str:
        return f"{self.module}.{self.function} calls {self.callee}{self.plugin}"


@dataclass(frozen=True, kw_only=True)
class ProtocolCovered(Expectation):
    """Every member of a vLLM protocol class is provided by the plugin's class: ``provided``
    maps member name -> the plugin's signature (``"(self)"``), or None for an attribute."""

    module: str
    cls: str
    provided: dict[str, str | None]

    def problems(self, tree: SourceTree) -> list[str]:
        found = self._class(tree, self.module, self.cls)
        if isinstance(found, str):
            return [found]
        out = []
        for name, member in tree.members(*found).items():
            if name.startswith("_"):
                continue
            where = f"{self.module}.{self.cls}.{name}"
            if name not in self.provided:
                out.append(f"{where} ({member.kind}) is not provided by the plugin")
                continue
            plugin = self.provided[name]
            is_fn = isinstance(member.node, ast.FunctionDef | ast.AsyncFunctionDef)
            if is_fn and plugin is None:
                out.append(f"{where} is a method, the plugin provides an attribute")
            elif is_fn:
                assert isinstance(member.node, ast.FunctionDef | ast.AsyncFunctionDef)
                base = Sig.of(member.node)
                if _kind_drops_first(member.kind):
                    base = base.drop_first()
                mine = Sig.parse(plugin)
                if mine.positional[:1] in (("self",), ("cls",)):
                    mine = mine.drop_first()
                out += [f"{where}: {p}" for p in override_problems(base, mine)]
        return out

    def describe(self) -> str:
        return f"the plugin provides every member of {self.module}.{self.cls}"


@dataclass(frozen=True, kw_only=True)
class AbstractsCovered(Expectation):
    """The plugin class implements every abstract method of its vLLM base class."""

    module: str
    cls: str
    implemented: tuple[str, ...]

    def problems(self, tree: SourceTree) -> list[str]:
        found = self._class(tree, self.module, self.cls)
        if isinstance(found, str):
            return [found]
        abstract = []
        for member in tree.members(*found).values():
            node = member.node
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and any(
                ast.unparse(d).split(".")[-1] == "abstractmethod" for d in node.decorator_list
            ):
                abstract.append(member.name)
        missing = [m for m in abstract if m not in self.implemented]
        if missing:
            return [f"{self.module}.{self.cls} has abstract {missing}, the plugin lacks them"]
        return []

    def describe(self) -> str:
        return f"the plugin implements every abstract method of {self.module}.{self.cls}"


def check(
    root: str | os.PathLike[str] | SourceTree,
    expectations: Iterable[Expectation],
    version: str | None = None,
) -> list[Failure]:
    """Run the expectations (those for ``version``, e.g. "0.33", when given) over a tree."""
    tree = root if isinstance(root, SourceTree) else SourceTree(root)
    failures = []
    for exp in expectations:
        if version is not None and version not in exp.versions:
            continue
        try:
            problems = exp.problems(tree)
        except SyntaxError as exc:  # a vLLM file this Python cannot parse
            problems = [f"cannot parse {exc.filename}: {exc.msg}"]
        failures += [Failure(exp.id, p) for p in problems]
    return failures


def source_version(root: str | os.PathLike[str] | SourceTree) -> str | None:
    """``vllm/_version.py``'s ``__version__`` (read, not imported), or None."""
    tree = root if isinstance(root, SourceTree) else SourceTree(root)
    mod = tree.module("vllm._version")
    if mod is None:
        return None
    for stmt in _runtime_statements(mod.tree.body):
        if "__version__" in _target_names(stmt):
            value = stmt.value  # type: ignore[attr-defined]
            if isinstance(value, ast.Constant) and isinstance(value.value, str):
                return value.value
    return None


def series(version: str) -> str:
    """``"0.33.0"`` -> ``"0.33"``."""
    return ".".join(version.split("+")[0].split(".")[:2])


# --------------------------------------------------------------------------- fetching


class FetchError(RuntimeError):
    """The vLLM wheel could not be downloaded or unpacked (the message says why)."""


@dataclass(frozen=True)
class FetchedSource:
    root: Path  # holds vllm/
    version: str
    wheel: str
    wheel_bytes: int
    cached: bool


def default_cache_root() -> Path:
    """``$KVARN_VLLM_SRC_CACHE``, else ``$XDG_CACHE_HOME/kvarn`` (``~/.cache/kvarn``)."""
    explicit = os.environ.get("KVARN_VLLM_SRC_CACHE")
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "kvarn"


STAMP = "COMPLETE"
#: The platform of the wheel downloaded: its .py files are the same in every build.
WHEEL_PLATFORM = "manylinux_2_28_x86_64"


def fetch_vllm_source(
    version: str,
    cache_root: Path | None = None,
    *,
    pip: Sequence[str] = (sys.executable, "-m", "pip"),
    timeout: float = 1800,
) -> FetchedSource:
    """The ``.py`` files of the vLLM ``version`` wheel from PyPI, unpacked once per version
    into ``<cache_root>/vllm-<version>/src`` (the wheel itself is not kept).

    Raises
    ------
    FetchError
        pip is missing or failed, the wheel is not the one asked for, or it cannot be read.
    """
    dest = (cache_root or default_cache_root()) / f"vllm-{version}"
    src, stamp = dest / "src", dest / STAMP
    if stamp.is_file() and (src / "vllm" / "__init__.py").is_file():
        wheel, _, size = stamp.read_text().strip().partition(" ")
        return FetchedSource(src, version, wheel, int(size or 0), cached=True)
    dest.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=dest, prefix="download-") as tmp:
        work = Path(tmp)
        cmd = [
            *pip,
            "download",
            "--no-deps",
            "--only-binary=:all:",
            "--platform",
            WHEEL_PLATFORM,
            "--disable-pip-version-check",
            "-d",
            str(work / "wheel"),
            f"vllm=={version}",
        ]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise FetchError(f"`{' '.join(cmd)}` did not run: {exc}") from exc
        if proc.returncode != 0:
            tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-15:])
            raise FetchError(
                f"`{' '.join(cmd)}` failed (exit {proc.returncode}); PyPI (or the configured "
                f"index) must be reachable and pip installed:\n{tail}"
            )
        wheels = sorted((work / "wheel").glob(f"vllm-{version}-*.whl"))
        if len(wheels) != 1:
            found = sorted(p.name for p in (work / "wheel").glob("*"))
            raise FetchError(f"expected one vllm-{version}-*.whl from pip, found {found}")
        wheel = wheels[0]
        size = wheel.stat().st_size
        unpacked = work / "src"
        try:
            with zipfile.ZipFile(wheel) as zf:
                names = [n for n in zf.namelist() if n.startswith("vllm/") and n.endswith(".py")]
                zf.extractall(unpacked, members=names)
        except (zipfile.BadZipFile, OSError) as exc:
            raise FetchError(f"{wheel.name}: cannot unpack: {exc}") from exc
        got = source_version(unpacked)
        if got != version:
            raise FetchError(f"{wheel.name}: vllm/_version.py says {got!r}, not {version!r}")
        if src.exists():
            shutil.rmtree(src)
        os.replace(unpacked, src)
        stamp.write_text(f"{wheel.name} {size}\n")
    return FetchedSource(src, version, wheel.name, size, cached=False)
