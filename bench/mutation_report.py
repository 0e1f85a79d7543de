"""Helper of bench/mutation.sh (run there, not by hand): lists the mutants of one module,
reads mutmut's verdicts back, and sums the run up against bench/mutation-survivors.md.

A mutant is keyed by module (path under daemon/gpuguard), function (`Class.method` or
`function`) and the mutated line's text, never by mutmut's numbered name: the numbers
change whenever a line is added above, and modules move (the key still matches once the
module column is updated).

    names   --module M --functions GLOBS [--sample N]   (in the scratch tree)
    widen                                               (in the scratch tree, after mutmut's stats)
    collect --module M --names FILE --out FILE.jsonl    (in the scratch tree)
    summary --results FILE.jsonl --equivalents MD --out TXT [--wall-file F]
"""
from __future__ import annotations

import argparse
import fnmatch
import json
import re
import sys
from collections import Counter
from pathlib import Path

SEP = "ǁ"  # mutmut's class separator in mangled names


def _src(module: str) -> Path:
    return Path("src/gpuguard") / module


def _dotted(module: str) -> str:
    return "gpuguard." + module[:-3].replace("/", ".")


def function_of(mangled: str) -> str:
    """`x_walk` -> `walk`; `xǁGpuPathǁlarge_bar` -> `GpuPath.large_bar`."""
    if mangled.startswith("x" + SEP):
        cls, _, meth = mangled[2:].rpartition(SEP)
        return f"{cls}.{meth}"
    return mangled[2:]


def cmd_names(a: argparse.Namespace) -> None:
    from mutmut.mutation.file_mutation import mutate_file_contents

    path = _src(a.module)
    mutated = mutate_file_contents(str(path), path.read_text())
    globs = a.functions.split()
    keep = []
    for name in mutated.mutant_names:
        func = function_of(name.partition("__mutmut_")[0])
        if any(fnmatch.fnmatchcase(func, g) for g in globs):
            keep.append(f"{_dotted(a.module)}.{name}")
    if a.sample > 1:
        keep = keep[:: a.sample]
    print("\n".join(keep))


def cmd_widen(a: argparse.Namespace) -> None:
    """mutmut runs, for a mutant, the tests that called its function while it recorded
    which test calls what. A module- or session-scoped fixture (a `Rules.load()` shared by
    a test file) is built in the first test's setup, so only that test is recorded; the
    tests asserting on what it built would never see the mutant. Run every test of a
    test file that called the function instead."""
    path = Path("mutants/mutmut-stats.json")
    stats = json.loads(path.read_text())
    by_file: dict[str, set[str]] = {}
    for test in stats["duration_by_test"]:
        by_file.setdefault(test.split("::")[0], set()).add(test)
    tbf = stats["tests_by_mangled_function_name"]
    before = sum(map(len, tbf.values()))
    for func, tests in tbf.items():
        files = {t.split("::")[0] for t in tests}
        tbf[func] = sorted(set(tests).union(*(by_file.get(f, set()) for f in files)))
    path.write_text(json.dumps(stats, indent=1))
    print(f"tests per function widened to their files: {before} -> {sum(map(len, tbf.values()))} (function, test) pairs")


def _lines(diff: str, mark: str) -> str:
    out = [ln[1:].strip() for ln in diff.splitlines() if ln.startswith(mark) and not ln.startswith(mark * 3)]
    return " ⏎ ".join(x for x in out if x)


def cmd_collect(a: argparse.Namespace) -> None:
    from mutmut.mutation.data import SourceFileMutationData
    from mutmut.mutation.diff_apply import get_diff_for_mutant
    from mutmut.stats import status_by_exit_code

    path = _src(a.module)
    data = SourceFileMutationData(path=path)
    data.load()
    names = [n for n in Path(a.names).read_text().split() if n]
    with open(a.out, "a") as out:
        for name in names:
            code = data.exit_code_by_key.get(name)
            status = status_by_exit_code[code]
            rec = {"module": a.module, "name": name, "status": status,
                   "function": function_of(name.rpartition(".")[2].partition("__mutmut_")[0])}
            if status not in ("killed", "timeout"):
                diff = get_diff_for_mutant(name, path=path)
                rec["original"] = _lines(diff, "-")
                rec["mutated"] = _lines(diff, "+")
                rec["diff"] = diff
            out.write(json.dumps(rec, ensure_ascii=False) + "\n")


def _cells(row: str) -> list[str]:
    """A markdown table row's cells; `\\|` is a literal bar (code such as `str | None`)."""
    parts = re.split(r"(?<!\\)\|", row.strip().strip("|"))
    return [p.strip().replace("\\|", "|") for p in parts]


def _code(cell: str) -> str:
    cell = cell.strip()
    m = re.fullmatch(r"(`+)\s?(.*?)\s?\1", cell)
    return m.group(2) if m else cell


def equivalents(md: Path) -> dict[tuple[str, str, str], str]:
    """Rows of the `## Equivalent` table: module | function | mutated line | why."""
    found: dict[tuple[str, str, str], str] = {}
    in_table = False
    for line in md.read_text().splitlines():
        if line.startswith("## "):
            in_table = line.lower().startswith("## equivalent")
            continue
        if not in_table or not line.startswith("|") or set(line) <= set("|-: "):
            continue
        cells = _cells(line)
        if len(cells) < 4 or cells[0].lower() == "module":
            continue
        found[(_code(cells[0]), _code(cells[1]), _code(cells[2]))] = cells[3]
    return found


KILLED = ("killed", "timeout")


def cmd_summary(a: argparse.Namespace) -> None:
    recs = [json.loads(ln) for ln in Path(a.results).read_text().splitlines() if ln.strip()]
    eq = equivalents(Path(a.equivalents)) if Path(a.equivalents).exists() else {}
    walls = {}
    if a.wall_file and Path(a.wall_file).exists():
        for ln in Path(a.wall_file).read_text().splitlines():
            mod, secs = ln.split()
            walls[mod] = float(secs)
    used = set()
    modules: list[str] = []
    for r in recs:
        if r["module"] not in modules:
            modules.append(r["module"])
        key = (r["module"], r["function"], r.get("mutated", ""))
        if r["status"] not in KILLED and key in eq:
            r["status"] = "equivalent"
            used.add(key)
    head = f"{'module':<24}{'mutants':>8}{'killed':>8}{'timeout':>8}{'survived':>9}{'no tests':>9}" \
           f"{'equiv':>6}{'other':>6}{'kill rate':>10}{'wall':>7}"
    rows = [head]
    tot: Counter = Counter()
    for mod in modules:
        c = Counter(r["status"] for r in recs if r["module"] == mod)
        n = sum(c.values())
        other = n - c["killed"] - c["timeout"] - c["survived"] - c["no tests"] - c["equivalent"]
        counted = n - c["equivalent"] - c["not checked"]
        rate = 100.0 * (c["killed"] + c["timeout"]) / counted if counted else 0.0
        wall = walls.get(mod)
        rows.append(f"{mod:<24}{n:>8}{c['killed']:>8}{c['timeout']:>8}{c['survived']:>9}{c['no tests']:>9}"
                    f"{c['equivalent']:>6}{other:>6}{rate:>9.1f}%{'' if wall is None else f'{wall:>6.0f}s':>7}")
        tot.update(c)
        tot["n"] += n
        tot["other"] += other
        tot["wall"] += wall or 0
    counted = tot["n"] - tot["equivalent"] - tot["not checked"]
    rate = 100.0 * (tot["killed"] + tot["timeout"]) / counted if counted else 0.0
    rows.append(f"{'total':<24}{tot['n']:>8}{tot['killed']:>8}{tot['timeout']:>8}{tot['survived']:>9}"
                f"{tot['no tests']:>9}{tot['equivalent']:>6}{tot['other']:>6}{rate:>9.1f}%{tot['wall']:>6.0f}s")
    table = "\n".join(rows)
    lines = [table, "",
             "kill rate = (killed + timeout) / (mutants - equivalent - not checked); 'no tests' counts as survived;",
             "'other' = suspicious, segfault or not checked (a run stopped by its budget).", ""]
    alive = [r for r in recs if r["status"] not in KILLED + ("equivalent",)]
    lines.append(f"survivors ({len(alive)}), not listed as equivalent in {a.equivalents}:")
    for r in alive:
        lines.append(f"- [{r['status']}] {r['module']} | {r['function']} | {r.get('mutated', '')}"
                     f"    (was: {r.get('original', '')})    [{r['name']}]")
    stale = [k for k in eq if k not in used and k[0] in modules]
    if stale:
        lines.append("")
        lines.append(f"listed as equivalent but no longer a survivor (killed now, moved or changed) ({len(stale)}):")
        lines.extend(f"- {m} | {f} | {t}" for m, f, t in stale)
    text = "\n".join(lines) + "\n"
    Path(a.out).write_text(text)
    print(table)
    print(f"\n{len(alive)} survivors not listed as equivalent; list written to {a.out}")
    if stale:
        print(f"{len(stale)} rows of {a.equivalents} match no survivor of this run (see {a.out})")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    n = sub.add_parser("names")
    n.add_argument("--module", required=True)
    n.add_argument("--functions", default="*")
    n.add_argument("--sample", type=int, default=1)
    sub.add_parser("widen")
    c = sub.add_parser("collect")
    c.add_argument("--module", required=True)
    c.add_argument("--names", required=True)
    c.add_argument("--out", required=True)
    s = sub.add_parser("summary")
    s.add_argument("--results", required=True)
    s.add_argument("--equivalents", required=True)
    s.add_argument("--out", required=True)
    s.add_argument("--wall-file")
    a = p.parse_args()
    {"names": cmd_names, "widen": cmd_widen, "collect": cmd_collect, "summary": cmd_summary}[a.cmd](a)


if __name__ == "__main__":
    sys.exit(main())
