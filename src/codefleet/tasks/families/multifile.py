"""Family `multifile`: tasks that need several files read.

Two shapes (see layered.py and aggregate.py):

- `checkout`, `payroll`: a bug in a helper module, seen only through the
  top-level function of another module;
- `warehouse`, `power`: implement a figure summed over 3-6 modules that each
  state their part differently.

The difficulty sets the number of member modules (aggregate), distractor
modules and whether the report points at the helpers.
"""

from __future__ import annotations

import random

from codefleet.tasks.families import aggregate, layered
from codefleet.tasks.families.base import SIZES, Case, Draft, DraftError, TestFile, project_files
from codefleet.tasks.families.layout import describe, distractors
from codefleet.tasks.families.mutate import shuffled_mutations

NAME = "multifile"
TEMPLATES = {"checkout": "train", "warehouse": "train", "payroll": "test", "power": "test"}

_LAYERED_REPORTS = (
    "`{call}` returns {got} but it should be {want}: {expected_why} The failing test is `{test}`. "
    "`{top_path}` itself looks right; it relies on the helper modules next to it. Please find and fix the bug.",
    "Customer report: `{call}` {got_plain}, expected {want}. `{test}` reproduces it. Fix the root cause; "
    "don't special-case the call.",
)
_LAYERED_VAGUE = ("`{call}` gives {got} instead of {want}. Find the root cause and fix it.",)
_WHY = {
    "checkout": "the subtotal minus the discount, plus tax on that, plus shipping, as the docstrings of "
    "the modules say.",
    "payroll": "regular hours at the grade's rate plus overtime pay, minus income tax, as the docstrings "
    "of the modules say.",
}
_AGGREGATE_ASKS = (
    "Implement `{func}` in `{path}`; it raises NotImplementedError. The docstring explains the figure. "
    "The {noun} modules are in `{folder}`.",
    "We need `{func}` ({path}) for {topic}. It is a stub right now — implement it as its docstring says, "
    "using every module in `{folder}`.",
)


def _layered(shape: layered.Layered, rng: random.Random, difficulty: int) -> Draft:
    size = SIZES[difficulty]
    package = rng.choice(shape.packages)
    base = project_files(package, f"{shape.topic} arithmetic") | {
        f"{package}/__init__.py": f'"""{shape.topic.capitalize()}."""\n'
    }
    correct = base | layered.package_modules(shape, package)
    top_module, top_func = f"{package}.{shape.top[0]}", shape.top[1]
    cases = shape.top_cases(rng)
    right = layered.top_outcomes(correct, top_module, top_func, cases)
    targets = list(shape.buggy)
    rng.shuffle(targets)
    for module, func in targets:
        path = f"{package}/{module}.py"
        for mutation in shuffled_mutations(correct[path], func, rng)[:8]:
            broken = dict(correct)
            broken[path] = mutation.apply(correct[path])
            wrong = layered.top_outcomes(broken, top_module, top_func, cases)
            changed = [i for i, (a, b) in enumerate(zip(right, wrong)) if a != b]
            if changed:
                break
        else:
            continue
        break
    else:
        raise DraftError(f"multifile/{shape.name}: no mutation shows at the top level")
    symptom = changed[0]
    passing = next((i for i in range(len(cases)) if i not in changed), symptom)
    visible, hidden_top, components = layered.test_files(shape, package, cases, symptom, passing)
    extra_files, extra_tests = distractors(None, package, size, rng)
    call = f"{top_func}({', '.join(repr(a) for a in cases[symptom])})"
    got = describe(wrong[symptom])
    fields = dict(
        call=call,
        got=got.removeprefix("returns "),
        got_plain=got.replace("`", ""),
        want=f"`{right[symptom][1]!r}`",
        test=f"{visible.path}::test_{top_func}_{symptom}",
        top_path=f"{package}/{shape.top[0]}.py",
        expected_why=_WHY[shape.name],
    )
    text = rng.choice(_LAYERED_VAGUE if size.vague else _LAYERED_REPORTS).format(**fields)
    return Draft(
        NAME,
        shape.name,
        text,
        before=broken | extra_files,
        after=correct | extra_files,
        visible=[visible, *extra_tests],
        hidden=[hidden_top, components],
    )


def _aggregate(shape: aggregate.Aggregate, rng: random.Random, difficulty: int) -> Draft:
    size = SIZES[difficulty]
    package = rng.choice(shape.packages)
    built = aggregate.build(shape, package, size.parts + 1, rng)
    summary = f"{package}.{shape.summary_module}"
    helper = shape.helper[0]
    visible = TestFile(
        f"tests/test_{shape.folder}.py",
        f"Tests of the {shape.noun} modules.",
        [Case(f"{package}.{shape.folder}.{m}", helper, (), f"test_{m}_{helper}") for m in built.members],
    )
    imports, factor_test = aggregate.factor_test(shape, package, built.raw_total)
    hidden = TestFile(
        f"tests/test_{shape.summary_module}.py",
        f"Tests of {summary}.",
        [Case(summary, shape.func, (), f"test_{shape.func}")],
        custom=factor_test,
        custom_imports=imports,
        custom_status={f"test_{shape.func}_reads_{shape.factor_module}_when_called": False},
    )
    extra_files, extra_tests = distractors(None, package, size, rng)
    base = project_files(package, shape.topic) | {f"{package}/__init__.py": f'"""{shape.topic.capitalize()}."""\n'}
    text = rng.choice(_AGGREGATE_ASKS).format(
        func=shape.func,
        path=f"{package}/{shape.summary_module}.py",
        noun=shape.noun,
        folder=f"{package}/{shape.folder}/",
        topic=shape.topic,
    )
    return Draft(
        NAME,
        shape.name,
        text,
        before=base | built.before | extra_files,
        after=base | built.after | extra_files,
        visible=[visible, *extra_tests],
        hidden=[hidden],
    )


def draft(template: str, rng: random.Random, difficulty: int) -> Draft:
    if template in layered.SHAPES:
        return _layered(layered.SHAPES[template], rng, difficulty)
    return _aggregate(aggregate.SHAPES[template], rng, difficulty)
