"""Multi-file shape B: implement a figure that depends on many modules.

`usable_capacity()` sums over every warehouse site module, `total_draw_watts()`
over every rack module; a factor lives in yet another module. Like real
legacy code, each module states its figure in its own way (constants with
different names, a dict, a list, a function), so every module must be read
(reading them in one turn of parallel calls pays off). The hidden tests
check the value and, by changing the factor with monkeypatch, that the
values are read when the function is called (which also rules out a
hard-coded number).
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class Form:
    """One way a module states its figure: source lines, the expression that reads it ({m}: the module)."""

    draw: Callable[[random.Random], dict]
    source: str
    expr: str
    value: Callable[[dict], int]


@dataclass(frozen=True)
class Aggregate:
    name: str
    packages: tuple[str, ...]
    topic: str
    folder: str
    noun: str
    names: tuple[str, ...]
    flag: str
    forms: tuple[Form, ...]
    factor_module: str
    factor_name: str
    factor_choices: tuple[int, ...]
    combine_src: str  # how the factor applies, with {total} and {factor}
    combine: Callable[[int, int], int]
    summary_module: str
    func: str
    func_doc: str  # with {package}, {folder}, {flag}, {factor_module}, {factor_name}
    helper: tuple[str, str]  # (function name, docstring) every member module has


WAREHOUSE = Aggregate(
    "warehouse",
    ("depotnet", "pallet_planner"),
    "warehouse capacity planning",
    "sites",
    "site",
    ("north", "south", "east", "west", "harbor", "airport", "central"),
    "OPEN",
    (
        Form(
            lambda r: {"cap": r.randrange(80, 400, 10), "res": r.randrange(0, 35, 5)},
            "CAPACITY_PALLETS = {cap}\nRESERVED_PALLETS = {res}\n",
            "{m}.CAPACITY_PALLETS - {m}.RESERVED_PALLETS",
            lambda p: p["cap"] - p["res"],
        ),
        Form(
            lambda r: {"cap": r.randrange(80, 400, 10), "res": r.randrange(5, 35, 5)},
            "# Legacy names: MAX_PALLETS is the capacity, RESERVED the pallets kept back for returns.\n"
            "MAX_PALLETS = {cap}\nRESERVED = {res}\n",
            "{m}.MAX_PALLETS - {m}.RESERVED",
            lambda p: p["cap"] - p["res"],
        ),
        Form(
            lambda r: {"racks": r.randint(4, 20), "per": r.choice([6, 8, 10, 12])},
            "# Capacity is racks x pallets per rack; this site reserves nothing.\n"
            'LAYOUT = {{"racks": {racks}, "pallets_per_rack": {per}}}\n',
            '{m}.LAYOUT["racks"] * {m}.LAYOUT["pallets_per_rack"]',
            lambda p: p["racks"] * p["per"],
        ),
        Form(
            lambda r: {"cap": r.randrange(100, 300, 10), "res": r.randrange(0, 25, 5)},
            'HOLD_BACK_PALLETS = {res}\n\n\ndef capacity_pallets():\n    """Pallet capacity since the rebuild."""\n'
            "    return {cap}\n",
            "{m}.capacity_pallets() - {m}.HOLD_BACK_PALLETS",
            lambda p: p["cap"] - p["res"],
        ),
    ),
    "policy",
    "SAFETY_MARGIN_PERCENT",
    (5, 10, 15, 20),
    "{total} * (100 - {factor}) // 100",
    lambda total, factor: total * (100 - factor) // 100,
    "summary",
    "usable_capacity",
    """Pallets the company can plan with.

    For every site module in {package}/{folder}/ whose {flag} is True: its pallet
    capacity minus the pallets it reserves (each site states these in its own
    way; read the modules). Sum that over the open sites, then keep
    (100 - {factor_name}) percent of it ({package}/{factor_module}.py), rounded down.
    Read every value when the function is called, not at import time.
    """,
    ("dock_doors", "Loading dock doors at this site."),
)

POWER = Aggregate(
    "power",
    ("rackpower", "dc_budget"),
    "data-centre power budgeting",
    "racks",
    "rack",
    ("alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf"),
    "POWERED",
    (
        Form(
            lambda r: {"n": r.randint(4, 24), "w": r.randrange(200, 600, 50)},
            "SERVERS = {n}\nWATTS_PER_SERVER = {w}\n",
            "{m}.SERVERS * {m}.WATTS_PER_SERVER",
            lambda p: p["n"] * p["w"],
        ),
        Form(
            lambda r: {"nodes": [r.randrange(150, 800, 50) for _ in range(r.randint(2, 5))]},
            "# Watts drawn by each node, one entry per node.\nNODE_WATTS = {nodes}\n",
            "sum({m}.NODE_WATTS)",
            lambda p: sum(p["nodes"]),
        ),
        Form(
            lambda r: {"c": r.randint(1, 4), "b": r.choice([8, 12, 16]), "w": r.randrange(80, 200, 10)},
            "CHASSIS = {c}\nBLADES_PER_CHASSIS = {b}\nBLADE_WATTS = {w}\n",
            "{m}.CHASSIS * {m}.BLADES_PER_CHASSIS * {m}.BLADE_WATTS",
            lambda p: p["c"] * p["b"] * p["w"],
        ),
        Form(
            lambda r: {"w": r.randrange(1000, 6000, 100)},
            'def measured_watts():\n    """Last metered draw of the rack."""\n    return {w}\n',
            "{m}.measured_watts()",
            lambda p: p["w"],
        ),
    ),
    "facility",
    "PUE_PERCENT",
    (120, 135, 150, 180),
    "{total} * {factor} // 100",
    lambda total, factor: total * factor // 100,
    "budget",
    "total_draw_watts",
    """Watts the facility draws for the racks.

    For every rack module in {package}/{folder}/ whose {flag} is True: the watts its
    equipment draws (each rack states this in its own way; read the modules).
    Sum that over the powered racks and scale it by {factor_name} percent
    ({package}/{factor_module}.py), rounded down.
    Read every value when the function is called, not at import time.
    """,
    ("height_units", "Rack height in rack units."),
)

SHAPES = {"warehouse": WAREHOUSE, "power": POWER}


@dataclass
class Built:
    before: dict[str, str]
    after: dict[str, str]
    value: int  # the function's result
    raw_total: int  # the sum before the factor (the result with the factor monkeypatched to neutral)
    members: list[str]


def build(shape: Aggregate, package: str, n_members: int, rng: random.Random) -> Built:
    members = sorted(rng.sample(shape.names, n_members))
    forms = [shape.forms[i % len(shape.forms)] for i in range(n_members)]
    rng.shuffle(forms)
    flags = [True] * n_members
    for i in rng.sample(range(n_members), max(1, n_members // 3)):
        flags[i] = False
    files = {f"{package}/{shape.folder}/__init__.py": f'"""One module per {shape.noun}."""\n'}
    total, lines = 0, []
    for name, form, flag in zip(members, forms, flags):
        params = form.draw(rng)
        helper, doc = shape.helper
        files[f"{package}/{shape.folder}/{name}.py"] = (
            f'"""The {name} {shape.noun}."""\n\n{shape.flag} = {flag}\n'
            + form.source.format(**params)
            + f'\n\ndef {helper}():\n    """{doc}"""\n    return {rng.randint(2, 12)}\n'
        )
        if flag:
            total += form.value(params)
        lines.append(f"    if {name}.{shape.flag}:\n        total += {form.expr.format(m=name)}\n")
    factor = rng.choice(shape.factor_choices)
    files[f"{package}/{shape.factor_module}.py"] = (
        f'"""Company-wide policy figures."""\n\n{shape.factor_name} = {factor}\n'
    )
    doc = shape.func_doc.format(
        package=package,
        folder=shape.folder,
        flag=shape.flag,
        factor_module=shape.factor_module,
        factor_name=shape.factor_name,
    )
    head = f'"""Company-wide figures computed from the {shape.noun} modules in {package}/{shape.folder}/."""\n'
    stub = f'{head}\n\ndef {shape.func}():\n    """{doc}"""\n    raise NotImplementedError\n'
    imports = (
        f"from {package} import {shape.factor_module}\nfrom {package}.{shape.folder} import {', '.join(members)}\n"
    )
    combine = shape.combine_src.format(total="total", factor=f"{shape.factor_module}.{shape.factor_name}")
    solution = (
        f'{head}\n{imports}\n\ndef {shape.func}():\n    """{doc}"""\n    total = 0\n'
        + "".join(lines)
        + f"    return {combine}\n"
    )
    before, after = dict(files), dict(files)
    before[f"{package}/{shape.summary_module}.py"] = stub
    after[f"{package}/{shape.summary_module}.py"] = solution
    neutral = 0 if shape.name == "warehouse" else 100
    return Built(before, after, shape.combine(total, factor), shape.combine(total, neutral), members)


def factor_test(shape: Aggregate, package: str, raw_total: int) -> tuple[str, str]:
    """(imports, test source) checking the factor is read at call time."""
    neutral = 0 if shape.name == "warehouse" else 100
    imports = f"from {package} import {shape.factor_module}"
    test = (
        f"def test_{shape.func}_reads_{shape.factor_module}_when_called(monkeypatch):\n"
        f'    monkeypatch.setattr({shape.factor_module}, "{shape.factor_name}", {neutral})\n'
        f"    assert {shape.func}() == {raw_total}\n"
    )
    return imports, test
