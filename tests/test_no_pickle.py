"""Issue 46: no unpickling of what another process or another account wrote.

`pickle.loads` runs whatever its bytes say, and so does `torch.load(weights_only=False)`: a
checkpoint planted in a run folder ran code as the job's user. This greps the package for
every way in to an unpickler; each hit must be in ALLOWED with the reason it reads only this
process's own bytes (or is named as open elsewhere). A new hit fails until it is removed or
argued for here.
"""
from __future__ import annotations

import ast
import re
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "pivotrl_hpc"

# what unpickles: pickle / cloudpickle / dill loads, an Unpickler, marshal, shelve, joblib,
# numpy's allow_pickle, and torch.load (unless the call says weights_only=True)
PATTERNS = [re.compile(p) for p in (
    r"\bpickle\.loads?\(", r"\bUnpickler\b", r"\bcloudpickle\b", r"\bimport dill\b",
    r"\bmarshal\.loads?\(", r"\bshelve\.open\(", r"\bjoblib\.load\(", r"allow_pickle\s*=\s*True",
    r"\btorch\.load\((?![^)]*weights_only\s*=\s*True)")]

# (file, the line's code) -> why it is safe
ALLOWED = {
    ("cli/bench_codec.py",
     "loads_us = best_us(lambda: pickle.loads(theirs), number, repeat)"):
        "`pivotrl bench codec` times pickle as the baseline of the typed wire: it loads the "
        "bytes it dumped itself a line before, in the same process",
    ("plan/parallel.py", "return pickle.loads(blob)"):
        "the planner's process pool: the blob is the simulator this process pickled, sent "
        "through the pool's private pipe to its own forked workers (no other account can "
        "reach the pipe)",
}


def _prose_lines(source: str) -> set[int]:
    """Lines of docstrings and other bare string statements: prose, not code. (Skipping every
    line that starts with a quote hid a dict entry `"k": pickle.loads(b)`.)"""
    lines = set()
    for node in ast.walk(ast.parse(source)):
        if (isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)
                and isinstance(node.value.value, str)):
            lines.update(range(node.lineno, node.end_lineno + 1))
    return lines


def _hits() -> list[tuple[str, int, str]]:
    out = []
    for path in sorted(PACKAGE.rglob("*.py")):
        source = path.read_text()
        prose = _prose_lines(source)
        for n, line in enumerate(source.splitlines(), 1):
            code = line.split("#", 1)[0].strip()
            if n in prose or not code:
                continue
            if any(p.search(code) for p in PATTERNS):
                out.append((str(path.relative_to(PACKAGE)), n, code))
    return out


def test_nothing_unpickles_outside_the_allow_list():
    found = _hits()
    unexpected = [f"{f}:{n}: {code}" for f, n, code in found if (f, code) not in ALLOWED]
    assert not unexpected, "unpickling outside the allow-list:\n" + "\n".join(unexpected)


def test_every_allow_list_entry_is_still_there_and_argued():
    found = {(f, code) for f, _, code in _hits()}
    stale = [k for k in ALLOWED if k not in found]
    assert not stale, f"allow-list entries no longer in the code (remove them): {stale}"
    assert all(len(why) > 40 for why in ALLOWED.values())


def test_the_grep_catches_each_form(tmp_path):
    """The patterns themselves: each way in is caught, weights_only=True is not."""
    caught = ["x = pickle.loads(b)", "pickle.load(f)", "u = pickle.Unpickler(f)",
              "import cloudpickle", "import dill", "marshal.loads(b)", "shelve.open(p)",
              "joblib.load(p)", "np.load(p, allow_pickle=True)", "torch.load(p)",
              "torch.load(p, map_location='cpu', weights_only=False)"]
    assert all(any(p.search(c) for p in PATTERNS) for c in caught)
    assert not any(p.search("torch.load(p, map_location=d, weights_only=True)")
                   for p in PATTERNS)


# mpi4py's lower-case calls pickle what they send and unpickle what they receive: every TCP
# listener of an MPI job accepts other accounts' connections, so the package moves its
# messages as `protocol.mpi` bytes (issue 51). A lower-case call is one of these names on a
# communicator-looking receiver, or with MPI's dest/source/root keywords.
MPI_PICKLING = {"send", "recv", "isend", "irecv", "ssend", "issend", "bsend", "ibsend",
                "sendrecv", "bcast", "gather", "allgather", "scatter", "alltoall", "reduce",
                "allreduce", "scan", "exscan", "mprobe", "improbe", "neighbor_allgather",
                "neighbor_alltoall"}
MPI_KEYWORDS = {"dest", "source", "root"}
COMM_NAME = re.compile(r"comm|world|agents|COMM_", re.I)


def _mpi_pickling_calls(source: str, name: str) -> list[str]:
    out = []
    for node in ast.walk(ast.parse(source, name)):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and node.func.attr in MPI_PICKLING):
            continue
        receiver = ast.unparse(node.func.value)
        if receiver == "mpi":   # protocol.mpi: the codec's own carriage
            continue
        if COMM_NAME.search(receiver) or {k.arg for k in node.keywords} & MPI_KEYWORDS:
            out.append(f"{name}:{node.lineno}: {ast.unparse(node)[:100]}")
    return out


def test_no_mpi_call_of_the_package_pickles():
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        found += _mpi_pickling_calls(path.read_text(), str(path.relative_to(PACKAGE)))
    assert not found, ("mpi4py's pickling lower-case calls (use protocol.mpi):\n"
                       + "\n".join(found))


def test_the_mpi_check_catches_each_form_and_spares_sockets():
    caught = ["comm.send(x, dest=1, tag=2)", "self.comm.recv(source=0, tag=71)",
              "world.bcast(v, root=0)", "self.world.allgather(h)", "agents.gather(x)",
              "MPI.COMM_WORLD.allreduce(1)", "c.isend(cmd, dest=3)", "node_comm.irecv(source=1)",
              "self.comm.improbe(source=0)", "x.scatter(parts, root=0)"]
    for code in caught:
        assert _mpi_pickling_calls(code, "f.py") == [f"f.py:1: {code}"], code
    spared = ["sock.send(b'x')", "conn.recv(4096)", "self.recv(0.5)", "functools.reduce(f, xs)",
              "t.gather(1, idx)", "comm.Send([b, MPI.BYTE], dest=1, tag=2)",
              "world.Allgatherv(a, b)", "comm.Bcast(buf, root=0)", "comm.Improbe(source=0)",
              "mpi.send(comm, WIRE, msg, dest=1, tag=71)", "mpi.bcast(world, PLAIN, v, root=0)"]
    for code in spared:
        assert _mpi_pickling_calls(code, "f.py") == [], code


def test_prose_is_skipped_and_a_dict_entry_is_not():
    source = ('"""Never pickle.loads(x) here."""\n'
              'd = {\n'
              '    "k": pickle.loads(b),\n'
              '}\n')
    assert _prose_lines(source) == {1}
    code = source.splitlines()[2].strip()
    assert any(p.search(code) for p in PATTERNS)
