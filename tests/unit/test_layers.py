"""The house's floors: arrows run down only (docs/architecture.md, "Module map")."""

from __future__ import annotations

import ast
import pathlib

PKG = pathlib.Path(__file__).resolve().parents[2] / "livemig"


def _imports(path: pathlib.Path) -> set[str]:
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            out.add(node.module)
    return out


def test_nothing_below_the_facade_imports_it():
    offenders = []
    for floor in ("runtime", "sandbox", "comm", "transfer", "rdzv"):
        for f in sorted((PKG / floor).rglob("*.py")):
            if any(m == "livemig.api" or m.startswith("livemig.api.") for m in _imports(f)):
                offenders.append(str(f.relative_to(PKG.parent)))
    assert not offenders, f"these import livemig.api, which sits above them: {offenders}"


def test_registry_is_the_bottom_of_runtime():
    mods = _imports(PKG / "runtime" / "registry.py")
    assert not [m for m in mods if m.startswith("livemig.runtime")], mods


def test_the_facade_stays_short():
    n = len((PKG / "api.py").read_text().splitlines())
    assert n <= 340, f"livemig/api.py has {n} lines: move protocol code into livemig/runtime/"


def test_ctx_holds_the_readme_verbs_and_nothing_else():
    """The user's ctx: the README verb table's names plus where the process stands. The
    runtime's callbacks (runtime.member.Callbacks, the Engine's state pull) and state live
    behind it, so nothing a user can reach on ctx is a protocol hook they could call by mistake."""
    from livemig.api import Context
    from livemig.runtime.member import Callbacks
    from livemig.runtime.pull import StatePull

    verbs = {"register", "steps", "epochs", "batches", "no_sync", "sync_gradients", "clip_grad_norm_", "step", "busy",
             "checkpoints", "warming_up", "log", "init_device_mesh"}  # fmt: skip
    where = {"rank", "world_size", "generation", "role"}
    public = {n for n in dir(Context) if not n.startswith("_")}
    assert public == verbs | where, sorted(public ^ (verbs | where))
    readme = (PKG.parent / "README.md").read_text()
    table = readme[readme.index("| livemig | DDP / Accelerate |") :].split("\n\n")[0]
    assert all(f"ctx.{v}" in table for v in verbs), [v for v in verbs if f"ctx.{v}" not in table]
    hooks = {n for n in dir(Callbacks) if not n.startswith("_")}
    assert hooks and not hooks & public and all(callable(getattr(StatePull, n, None)) for n in hooks)


def _methods(cls: type) -> set[str]:
    """The methods and properties a class has, its livemig bases' included (dunders but
    __init__ left out): what a reader of the class must hold in mind."""
    names = set()
    for k in cls.__mro__:
        if k.__module__.startswith("livemig"):
            names |= {n for n, v in vars(k).items() if (callable(v) or isinstance(v, property | staticmethod))
                      and (n == "__init__" or not n.startswith("__"))}  # fmt: skip
    return names


def test_no_class_on_the_member_side_is_a_god_object():
    """The Engine behind ctx is the step loop over the member's fields, at most 25 methods
    (its bases included: a mixin is no way round it); no class of the runtime more than 30:
    a new concern is a collaborator of its own (runtime/boundary.py, runtime/pull.py, ...)."""
    import importlib

    from livemig.api import Engine

    assert len(_methods(Engine)) <= 25, sorted(_methods(Engine))
    big = []
    for f in sorted((PKG / "runtime").rglob("*.py")):
        mod = importlib.import_module("livemig." + ".".join(f.relative_to(PKG).with_suffix("").parts))
        for name, cls in vars(mod).items():
            if isinstance(cls, type) and cls.__module__ == mod.__name__ and len(_methods(cls)) > 30:
                big.append(f"{mod.__name__}.{name}: {len(_methods(cls))}")
    assert not big, big


def _import_time_nodes(tree: ast.Module):
    """What runs when the module is imported: module-level statements and class bodies,
    not function bodies (nor lambdas: a dataclass default_factory runs at construction)."""
    todo = list(tree.body)
    while todo:
        node = todo.pop()
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
            continue
        yield node
        todo.extend(ast.iter_child_nodes(node))


def test_no_module_reads_the_environment_at_import():
    """A setting read at import is fixed before a test, a launcher or an operator can set
    it for the process: every LIVEMIG_* value is read when used."""
    offenders = []
    for f in sorted(PKG.rglob("*.py")):
        for node in _import_time_nodes(ast.parse(f.read_text())):
            if isinstance(node, ast.Attribute) and node.attr in ("environ", "getenv"):
                if isinstance(node.value, ast.Name) and node.value.id == "os":
                    offenders.append(f"{f.relative_to(PKG.parent)}:{node.lineno}")
    assert not offenders, f"os.environ read at import: {offenders}"


def test_every_livemig_setting_is_named_in_config():
    """One schema for the environment: `ENV_X = "LIVEMIG_..."` only in livemig/config.py."""
    offenders = []
    for f in sorted(PKG.rglob("*.py")):
        if f == PKG / "config.py":
            continue
        for node in ast.parse(f.read_text()).body:
            if (isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant)
                    and isinstance(node.value.value, str) and node.value.value.startswith("LIVEMIG_")):  # fmt: skip
                offenders.append(f"{f.relative_to(PKG.parent)}:{node.lineno}")
    assert not offenders, f"LIVEMIG_* names defined outside livemig/config.py: {offenders}"


# Floors of the house, top first (docs/architecture.md, "Module map"): a room imports only
# rooms on its floor or below. The foundation is livemig's loose modules.
FLOORS = [
    {"cli", "spare_pool", "bench"},
    {"agent"},
    {"coordinator"},
    {"api", "livemig"},
    {"runtime", "sandbox"},
    {"comm", "transfer"},
    {"rdzv"},
    {"fault_gate", "faults", "state", "data", "checkpoint_dir", "references", "device"},
    {"config", "logs", "errors"},
]


def _modules() -> dict[str, pathlib.Path]:
    out = {}
    for f in PKG.rglob("*.py"):
        parts = list(f.relative_to(PKG.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = f
    return out


def _graph() -> dict[str, set[str]]:
    """Module -> the livemig modules it imports (anywhere in it: a lazy import is an arrow too)."""
    mods = _modules()

    def resolve(name: str) -> str:
        while name and name not in mods:
            name = name.rsplit(".", 1)[0] if "." in name else ""
        return name

    g: dict[str, set[str]] = {}
    for m, f in mods.items():
        out = set()
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("livemig"):
                for a in node.names:
                    full = f"{node.module}.{a.name}"
                    out.add(full if full in mods else resolve(node.module))
            elif isinstance(node, ast.Import):
                out.update(resolve(a.name) for a in node.names if a.name.startswith("livemig"))
        g[m] = {x for x in out if x and x != m}
    return g


def _room(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "livemig"


def test_imports_run_down_the_floors_only():
    floor = {room: i for i, rooms in enumerate(FLOORS) for room in rooms}
    rooms = {_room(m) for m in _modules()}
    assert rooms <= set(floor), f"rooms on no floor (add them to FLOORS and the module map): {rooms - set(floor)}"
    up = sorted(f"{m} -> {o}" for m, outs in _graph().items() for o in outs
                if floor[_room(o)] < floor[_room(m)])  # fmt: skip
    assert not up, f"imports that go up a floor: {up}"


def test_no_import_circles():
    g = _graph()
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    circles = []

    def visit(v: str) -> None:  # Tarjan: a strongly connected component of more than one module is a circle
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in g[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                circles.append(sorted(comp))

    for v in sorted(g):
        if v not in index:
            visit(v)
    assert not circles, f"import circles: {circles}"


def test_the_module_map_lists_every_module():
    text = (PKG.parent / "docs" / "architecture.md").read_text()
    block = text[text.index("## Module map") :].split("```text", 1)[1].split("```", 1)[0]
    listed: set[str] = set()
    folders: list[tuple[int, str]] = []  # (indent, path) of the folders open above the line
    for line in block.splitlines()[1:]:  # the first line is livemig/
        name = line.strip().split()[0] if line.strip() else ""
        if not name or name == "livemig/":
            continue
        indent = len(line) - len(line.lstrip())
        while folders and folders[-1][0] >= indent:
            folders.pop()
        prefix = folders[-1][1] if folders else ""
        if name.endswith("/"):
            folders.append((indent, prefix + name))
        elif name.endswith(".py"):
            listed.add(prefix + name)
    files = {str(f.relative_to(PKG)) for f in PKG.rglob("*.py")}
    files -= {str(f.relative_to(PKG)) for f in (PKG / "bench").rglob("*.py")}  # one line: bench/
    files -= {"spare_pool/__init__.py", "sandbox/__init__.py", "comm/__init__.py", "transfer/__init__.py",
              "rdzv/__init__.py", "runtime/__init__.py", "coordinator/__init__.py", "agent/__init__.py"}  # fmt: skip
    assert not files - listed, f"modules missing from the module map: {sorted(files - listed)}"
    assert not listed - files, f"the module map lists modules that do not exist: {sorted(listed - files)}"


# -- one strategy a kind of parallelism (livemig/runtime/strategies/) ----------------------------
STRATEGIES = PKG / "runtime" / "strategies"
STRATEGY_CLASSES = {"Strategy", "Replicated", "Zero1", "Fsdp2"}
KIND_NAMES = {"zero1", "fsdp2", "replicated"}
# The member side: what runs in a worker or spare. The coordinator reads a job's layout from its
# signature (coordinator/sharding.py) in a process with no strategy object; bench/ and cli/ take
# --sharding as an option of their own.
MEMBER_SIDE = ("api.py", "runtime", "sandbox", "comm", "transfer")


def _member_files() -> list[pathlib.Path]:
    out: list[pathlib.Path] = []
    for part in MEMBER_SIDE:
        p = PKG / part
        out += [p] if p.is_file() else sorted(p.rglob("*.py"))
    return [f for f in out if STRATEGIES not in f.parents]


def _kind_branches(tree: ast.AST) -> list[tuple[int, str]]:
    """Where code outside the strategies asks which kind of parallelism runs."""
    hits = []
    for n in ast.walk(tree):
        if isinstance(n, ast.Attribute) and n.attr in ("fsdp", "zero", "sharding") and isinstance(n.ctx, ast.Load):
            hits.append((n.lineno, ast.unparse(n)))
        elif isinstance(n, ast.Compare):
            names = {c.value for c in ast.walk(n) if isinstance(c, ast.Constant) and isinstance(c.value, str)}
            if names & KIND_NAMES or any(isinstance(x, ast.Name) and x.id == "sharding"
                                         for x in (n.left, *n.comparators)):  # fmt: skip
                hits.append((n.lineno, ast.unparse(n)))
        elif isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id in ("isinstance", "issubclass"):
            classes = {c.id for c in ast.walk(n.args[1]) if isinstance(c, ast.Name)} if len(n.args) > 1 else set()
            if classes & STRATEGY_CLASSES:
                hits.append((n.lineno, ast.unparse(n)))
    return hits


def test_no_branch_on_the_kind_of_parallelism_outside_the_strategies():
    offenders = [f"{f.relative_to(PKG.parent)}:{line}: {src}"
                 for f in _member_files() for line, src in _kind_branches(ast.parse(f.read_text()))]  # fmt: skip
    assert not offenders, "branch on the kind of parallelism: ask the strategy instead\n" + "\n".join(offenders)


def test_the_kind_check_finds_a_branch():
    """The rule above can fail: each shape of branch it forbids is found."""
    src = ("if reg.fsdp is not None: pass\nif sharding == 'zero1': pass\nif isinstance(s, Zero1): pass\n"
           "if self.reg.zero is None: pass\nx = 'fsdp2' if a == 'fsdp2' else 1\n")  # fmt: skip
    assert sorted(line for line, _ in _kind_branches(ast.parse(src))) == [1, 2, 3, 4, 5]


def _defined_private_names() -> set[str]:
    """Underscore names livemig itself defines (attributes it sets, methods, functions)."""
    names: set[str] = set()
    for f in PKG.rglob("*.py"):
        for n in ast.walk(ast.parse(f.read_text())):
            if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef) and n.name.startswith("_"):
                names.add(n.name)
            elif isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Store) and n.attr.startswith("_"):
                names.add(n.attr)
            elif isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name) and n.target.id.startswith("_"):
                names.add(n.target.id)
    return {n for n in names if not n.startswith("__")}


THEIRS = {"_allgather_base", "_reduce_scatter_base", "_timeout", "_devices"}  # torch's ProcessGroup and Options


def _modules_imported(tree: ast.AST) -> set[str]:
    names: set[str] = set()
    for n in ast.walk(tree):
        if isinstance(n, ast.Import):
            names |= {a.asname or a.name.split(".")[0] for a in n.names}
    return names


def test_no_object_reads_another_objects_underscore_attributes():
    """Only `self._x` (and `cls._x`): a collaborator receives what it uses under a public name.
    Third-party privates (torch's, pyetcd's) are not livemig's to rename."""
    ours = _defined_private_names()
    offenders = []
    for f in sorted(PKG.rglob("*.py")):
        tree = ast.parse(f.read_text())
        mods = _modules_imported(tree)  # os._exit, threading._shutdown: a module's, not an object's
        for n in ast.walk(tree):
            if (isinstance(n, ast.Attribute) and n.attr in ours - THEIRS
                    and not (isinstance(n.value, ast.Name) and n.value.id in ("self", "cls", *mods))):  # fmt: skip
                offenders.append(f"{f.relative_to(PKG.parent)}:{n.lineno}: {ast.unparse(n)}")
    assert not offenders, "another object's underscore attribute:\n" + "\n".join(offenders)


def test_no_underscore_name_is_imported_across_modules():
    offenders = []
    for f in sorted([*PKG.rglob("*.py"), *PKG.parent.joinpath("tests").rglob("*.py")]):
        for n in ast.walk(ast.parse(f.read_text())):
            if isinstance(n, ast.ImportFrom) and (n.module or "").startswith(("livemig", "tests")):
                offenders += [f"{f.relative_to(PKG.parent)}: {n.module}.{a.name}" for a in n.names
                              if a.name.startswith("_") and not a.name.startswith("__")]  # fmt: skip
    assert not offenders, "a module's private name imported elsewhere:\n" + "\n".join(offenders)


def test_etcd_transactions_are_built_in_rdzv():
    """The coordinator, the agents and the spare pool say what to write (rdzv/writes.py: a new
    generation, the table rewritten, claims, guarded records, a record put only if absent);
    the compares and ops of a transaction are built in rdzv/ only. The benches, which write
    thousands of simulated ranks' records as fast as etcd takes them, are outside the rule."""
    offenders = []
    for f in sorted(PKG.rglob("*.py")):
        if f.relative_to(PKG).parts[0] in ("rdzv", "bench"):
            continue
        for n in ast.walk(ast.parse(f.read_text())):
            if isinstance(n, ast.Attribute) and n.attr in ("txn_ops", "txn", "commit_change", "gen_is"):
                offenders.append(f"{f.relative_to(PKG.parent)}:{n.lineno}: {ast.unparse(n)}")
    assert not offenders, "a transaction built outside rdzv/:\n" + "\n".join(offenders)
