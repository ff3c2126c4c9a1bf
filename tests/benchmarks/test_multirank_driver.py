"""The shared driver of the multi-rank CPU-truth benchmarks (benchmarks/common.py, MultiRankBenchmark):
case selection, the meta block, the result files after every case, the worker's marker line, and the
four benchmarks built on it keeping their command lines."""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root, for `benchmarks`

from benchmarks.common import MultiRankBenchmark, merge_result_files, result_marker  # noqa: E402


@dataclass(frozen=True)
class _Case:
    name: str
    size: int = 1


_CASES = {"a": _Case("a", 1), "b": _Case("b", 2), "c": _Case("c", 3)}


def _bench(**kw) -> tuple[MultiRankBenchmark, list[str]]:
    measured: list[str] = []  # the cases measure saw, in order

    def measure(case, args):
        measured.append(case.name)
        return {"case": case.name, "bytes": case.size * args.steps}

    def render(rows, meta):
        return f"# t\n{meta['command']}\n" + "".join(f"| {r['case']} | {r['bytes']} |\n" for r in rows)

    bench = MultiRankBenchmark(name="demo_cpu", doc="Demo.\n\nMore.", case_type=_Case, cases=lambda: _CASES,
                               worker=lambda case, args: {"rank": 0, "size": case.size, "steps": args.steps},
                               measure=measure, render_markdown=render, describe=lambda row: str(row["bytes"]), **kw)
    return bench, measured


def test_measures_the_selected_cases_and_writes_both_files_with_the_meta_block(tmp_path, capsys):
    bench, measured = _bench()
    assert bench.main(["--cases", "c,a", "--steps", "5", "--runs", "2", "--out", str(tmp_path)]) == 0
    assert measured == ["c", "a"]  # in the order asked for
    data = json.loads((tmp_path / "demo_cpu.json").read_text())
    # the figures are measure's (size x steps); the meta block names the exact command and the run
    assert data["rows"] == [{"case": "c", "bytes": 15}, {"case": "a", "bytes": 5}]
    meta = data["meta"]
    assert meta["command"] == f"python benchmarks/demo_cpu.py --cases c,a --steps 5 --runs 2 --out {tmp_path}"
    assert meta["runs"] == 2 and meta["steps"] == 5 and meta["cases_done"] == "2 of 2"
    assert meta["date"].endswith(" UTC") and "cpu_model" in meta["machine"] and meta["machine"]["torch_threads"] == 1
    md = (tmp_path / "demo_cpu.md").read_text()
    assert md == f"# t\n{meta['command']}\n| c | 15 |\n| a | 5 |\n"
    out = capsys.readouterr().out
    assert "c: 15  [" in out and md in out


def test_default_and_all_cases_and_an_unknown_one(tmp_path):
    bench, measured = _bench()
    bench.main(["--out", str(tmp_path)])
    assert measured == ["a", "b", "c"]  # no --cases: every case
    only, measured = _bench(default_cases=("b",))
    only.main(["--out", str(tmp_path)])
    only.main(["--cases", "all", "--out", str(tmp_path)])
    assert measured == ["b", "a", "b", "c"]  # the defaults, then all of them
    with pytest.raises(SystemExit):
        _bench()[0].main(["--cases", "a,zz", "--out", str(tmp_path)])


def test_a_mode_writes_its_rows_without_measuring(tmp_path):
    def mode(args, ap):
        return ([{"case": "m", "bytes": 7}], {"command": "merged"}) if args.merge else None

    bench, measured = _bench(mode=mode, add_arguments=lambda ap: ap.add_argument("--merge", action="store_true"))
    bench.main(["--merge", "--out", str(tmp_path)])
    assert measured == []
    assert json.loads((tmp_path / "demo_cpu.json").read_text()) == {"meta": {"command": "merged"},
                                                                    "rows": [{"case": "m", "bytes": 7}]}


def test_merging_result_files_keeps_the_later_row_and_says_which_run_stopped_short(tmp_path):
    first = {"meta": {"command": "python b.py --runs 3", "date": "d1", "runs": 3, "cases_done": "2 of 5"},
             "rows": [{"case": "b", "v": 1}, {"case": "a", "v": 1}]}
    second = {"meta": {"command": "python b.py --runs 2 --cases b,c", "date": "d2", "runs": 2, "cases_done": "2 of 2"},
              "rows": [{"case": "b", "v": 2}, {"case": "c", "v": 2}]}
    paths = []
    for k, data in enumerate((first, second)):
        paths.append(tmp_path / f"{k}.json")
        paths[-1].write_text(json.dumps(data))
    rows, meta = merge_result_files("b", paths, ["a", "b", "c", "d"])
    assert rows == [{"case": "a", "v": 1}, {"case": "b", "v": 2}, {"case": "c", "v": 2}]  # case order, b from the later
    assert meta["command"] == ("python b.py --runs 3 (stopped after 2 of 5 cases) ; python b.py --runs 2 --cases b,c"
                               " ; then --merge of the 2 b.json files they wrote")
    assert (meta["date"], meta["runs"], meta["cases_done"]) == ("d1 ; d2", "2 or 3", "3 of 4")


def test_a_worker_prints_its_result_on_the_marker_line(capsys):
    _bench()[0].main(["--worker", json.dumps({"name": "b", "size": 2}), "--steps", "3"])
    line = capsys.readouterr().out.strip()
    assert line == result_marker("demo_cpu") + json.dumps({"rank": 0, "size": 2, "steps": 3})
    assert result_marker("fsdp2_cpu") == "@@FSDP2_CPU_RESULT@@ "  # the marker every earlier run printed


@pytest.mark.parametrize("module,flags", [
    ("fsdp1_cpu", ["--cases", "--runs", "--steps", "--timeout", "--out", "--merge"]),
    ("fsdp2_cpu", ["--cases", "--runs", "--steps", "--timeout", "--out", "--merge"]),
    ("layouts_cpu", ["--cases", "--runs", "--steps", "--timeout", "--out", "--merge"]),
    ("powersgd_cpu", ["--cases", "--runs", "--steps", "--timeout", "--out"]),
    ("deepspeed_cpu", ["--cases", "--runs", "--steps", "--warmup", "--timeout", "--out", "--rescore", "--before",
                       "--before-commit"]),
])
def test_each_benchmark_keeps_its_command_line(module, flags):
    pytest.importorskip("transformers")
    bench = __import__(f"benchmarks.{module}", fromlist=["BENCHMARK"]).BENCHMARK
    ap = bench.parser()
    assert {a for action in ap._actions for a in action.option_strings} == {"-h", "--help", "--worker", *flags}
    # the defaults every result file so far was made with
    defaults = ap.parse_args([])
    assert (defaults.runs, defaults.steps, defaults.timeout) == (
        (1, 2, 600.0) if module == "deepspeed_cpu" else (3, 2, 300.0))
