"""bench.decode_exact end to end on a small grid: the C++ kernel and the PyTorch path of
decode rows' exact part run, agree, and are timed; bad arguments are refused with the flag
named."""

import json

import pytest

from bench.decode_exact import main


def test_both_paths_timed_on_the_same_inputs(tmp_path):
    from vllm_lowbit_kv.ops import cpu

    if cpu.load_library():
        pytest.skip("the C++ kernel did not build here")
    out = tmp_path / "d.json"
    main(["--batch", "2,5", "--exact", "9,140", "--rounds", "2", "--calls", "1",
          "--json", str(out)])
    result = json.loads(out.read_text())
    assert result["kernels"] == ["exact_cpp", "torch_gathered"]
    assert "cpu" in result["machine"]
    cells = [(r["staging"], r["exact"], r["batch"]) for r in result["rows"]]
    assert cells == [(s, e, b) for s in ("int8", "model") for e in (9, 140) for b in (2, 5)]
    for r in result["rows"]:
        assert all(len(t) == 2 and min(t) > 0 for t in r["ms_all"].values())
        assert r["x_cpp"]["exact_cpp"] == 1.0 and r["max_out_diff"] <= 1e-3
    assert (tmp_path / "d.png").stat().st_size > 0


@pytest.mark.parametrize("argv,flag", [(["--batch", "a"], "--batch"), (["--exact", "5"], "--exact"),
                                       (["--staging", "fp8"], "--staging"),
                                       (["--rounds", "0"], "--rounds"),
                                       (["--q-heads", "8"], "--q-heads"),
                                       (["--head-dim", "40"], "--head-dim")])
def test_bad_arguments_name_the_flag(argv, flag, capsys):
    with pytest.raises(SystemExit):
        main(argv)
    assert flag in capsys.readouterr().err
