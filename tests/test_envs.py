"""The registry of environment variables (pivotrl_hpc/envs.py): every read of the package
goes through it, the README's table is the registry's, a bad value is a clear error."""
from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from pivotrl_hpc import envs

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "pivotrl_hpc"
NAME = re.compile(r"PIVOTRL_[A-Z0-9_]+")
# files that cannot import the registry: the Slurm epilog runs gps/epilog.py as root with the
# system Python (`python3 -I`), standard library only; it names its one variable itself
STANDALONE = {"gps/epilog.py"}


def _is_environ(node: ast.AST) -> bool:
    """`os.environ` or a bare `environ`."""
    return (isinstance(node, ast.Attribute) and node.attr == "environ") or \
        (isinstance(node, ast.Name) and node.id == "environ")


def direct_reads(source: str) -> list[tuple[int, str]]:
    """(line, name) of each variable a module names itself instead of through the registry:
    a PIVOTRL_* string anywhere, or a registered name read by os.environ[...], .get(...),
    os.getenv(...) or `in os.environ`."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) \
                and NAME.fullmatch(node.value):
            found.append((node.lineno, node.value))
        key = None
        if isinstance(node, ast.Subscript) and _is_environ(node.value) \
                and isinstance(node.ctx, ast.Load):   # setting one for a child is no read
            key = node.slice
        elif isinstance(node, ast.Call) and node.args and isinstance(node.func, ast.Attribute) \
                and (node.func.attr == "getenv" or node.func.attr == "get"
                     and _is_environ(node.func.value)):
            key = node.args[0]
        elif isinstance(node, ast.Compare) and any(_is_environ(c) for c in node.comparators):
            key = node.left
        if isinstance(key, ast.Constant) and key.value in envs.REGISTRY \
                and not NAME.fullmatch(key.value):
            found.append((node.lineno, key.value))
    return found


def test_no_module_reads_a_registered_variable_directly():
    bad = [f"{path.relative_to(ROOT)}:{line}: {name}"
           for path in sorted(PACKAGE.rglob("*.py")) if path.name != "envs.py"
           and str(path.relative_to(PACKAGE)) not in STANDALONE
           for line, name in direct_reads(path.read_text())]
    assert not bad, "read these through pivotrl_hpc.envs:\n" + "\n".join(bad)


def test_the_standalone_epilog_names_the_registered_variable_and_imports_no_package():
    from pivotrl_hpc.gps import epilog

    assert epilog.SHM_DIR_ENV == envs.SHM_DIR.name
    for path in STANDALONE:
        tree = ast.parse((PACKAGE / path).read_text())
        imported = [n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)] + [
            a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
        assert not [m for m in imported if m and m.startswith("pivotrl_hpc")], path


@pytest.mark.parametrize("source", [
    'import os\nx = os.environ["PIVOTRL_SHM_DIR"]',
    'import os\nx = os.environ.get("PIVOTRL_RUN_ID", "")',
    'import os\nx = os.getenv("PIVOTRL_LOG_LEVEL")',
    'import os\nx = "SLURM_JOB_ID" in os.environ',
    'from os import environ\nx = environ.get("SLURM_CONF")',
    'NAME = "PIVOTRL_NOT_REGISTERED"',
])
def test_the_scan_finds_a_direct_read(source):
    assert direct_reads(source)


def test_the_scan_leaves_registry_reads_and_other_names_alone():
    assert not direct_reads('from pivotrl_hpc import envs\nx = envs.SHM_DIR.get()\n'
                            'import os\ny = os.environ.get("HOME")\n'
                            '"""PIVOTRL_SHM_DIR in a sentence is documentation."""')


def test_every_pivotrl_name_the_package_mentions_is_registered():
    """Docstrings and messages too: a name renamed or dropped from the registry is not
    left behind in the text."""
    named = {(p.relative_to(ROOT), n) for p in PACKAGE.rglob("*.py")
             for n in NAME.findall(p.read_text())}
    assert {n for _, n in named} - set(envs.REGISTRY) == set(), sorted(
        (str(p), n) for p, n in named if n not in envs.REGISTRY)


def test_each_variable_has_a_type_a_parsable_default_and_a_meaning():
    assert len(envs.REGISTRY) >= 24
    for name, var in envs.REGISTRY.items():
        assert var.name == name and var.meaning and var.type in (str, int, float, bool)
        assert var.default is None or isinstance(var.default, var.type), name
        if var.default is not None:   # the default written out reads back as itself
            written = str(var.default).lower() if var.type is bool else str(var.default)
            assert var.get({name: written}) == var.default, name


def test_values_are_typed_and_a_bad_one_names_the_variable():
    assert envs.GPS_REQUEST_S.get({}) == 30.0
    assert envs.GPS_REQUEST_S.get({"PIVOTRL_GPS_REQUEST_S": "2.5"}) == 2.5
    assert envs.GPS_REQUEST_S.get({"PIVOTRL_GPS_REQUEST_S": ""}) == 30.0   # empty: unset
    assert envs.PORT_BASE.get({"PIVOTRL_PORT_BASE": "41000"}) == 41000
    assert envs.GPS_NO_REGISTER.get({"PIVOTRL_GPS_NO_REGISTER": "1"}) is True
    assert envs.GPS_NO_REGISTER.get({}) is False
    with pytest.raises(envs.EnvError, match=r"PIVOTRL_PORT_BASE='4l000' is not a int"):
        envs.PORT_BASE.get({"PIVOTRL_PORT_BASE": "4l000"})
    with pytest.raises(envs.EnvError, match="PIVOTRL_GPS_NO_REGISTER='yes'"):
        envs.GPS_NO_REGISTER.get({"PIVOTRL_GPS_NO_REGISTER": "yes"})


def test_the_one_fault_hook_counts_by_name():
    env = {"PIVOTRL_TEST_FAULTS": "gps_nacks=7, other=2"}
    assert envs.fault("gps_nacks", env) == 7 and envs.fault("other", env) == 2
    assert envs.fault("gps_nacks", {}) == 0 and envs.fault("missing", env) == 0
    assert envs.faults(env) == {"gps_nacks": 7, "other": 2} and envs.faults({}) == {}
    with pytest.raises(envs.EnvError, match="'gps_nacks=x' is not name=count"):
        envs.fault("gps_nacks", {"PIVOTRL_TEST_FAULTS": "gps_nacks=x"})


def test_the_readme_table_is_the_registry():
    text = (ROOT / "README.md").read_text()
    begin, end = "<!-- envs: begin", "<!-- envs: end -->"
    assert begin in text and end in text
    table = text.split(begin, 1)[1].split("-->", 1)[1].split(end, 1)[0]
    assert table.strip() == envs.markdown().strip(), \
        "regenerate the README's table: python -m pivotrl_hpc.envs"
