"""bench.prefill_exact end to end on a small grid: both kernels of a prefill chunk's exact
part run, agree, and are timed; bad arguments are refused with the flag named."""

import json

import pytest

from bench.prefill_exact import main


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_both_kernels_timed_on_the_same_rows(tmp_path, dtype):
    from vllm_lowbit_kv.ops import cpu

    if cpu.load_library():
        pytest.skip("the C++ kernel did not build here")
    out = tmp_path / "p.json"
    main(["--rows", "32,96", "--rounds", "2", "--calls", "1", "--dtype", dtype,
          "--json", str(out)])
    result = json.loads(out.read_text())
    assert result["kernels"] == ["dense_cpp", f"torch_{dtype}"] and result["dtype"] == dtype
    assert "cpu" in result["machine"] and isinstance(result["amx_tiles"], bool)
    assert [r["rows"] for r in result["rows"]] == [32, 96]
    for r in result["rows"]:
        assert all(len(t) == 2 and min(t) > 0 for t in r["ms_all"].values())
        assert r["x_dense"]["dense_cpp"] == 1.0 and r["max_out_diff"] <= 0.05
    assert (tmp_path / "p.png").stat().st_size > 0


@pytest.mark.parametrize("argv,flag", [(["--rows", "a,2"], "--rows"), (["--rounds", "0"], "--rounds"),
                                       (["--q-heads", "8"], "--q-heads"),
                                       (["--dtype", "float16"], "--dtype")])
def test_bad_arguments_name_the_flag(argv, flag, capsys):
    with pytest.raises(SystemExit):
        main(argv)
    assert flag in capsys.readouterr().err
