"""bench.decode's arguments (its measurement runs servers: bench/results/decode_cpu*.json)."""

import pytest

from bench.decode import main


@pytest.mark.parametrize("argv", [["--dtype", "float32"],
                                  ["--dtype", "float32", "--kv-cache-dtype", "bfloat16,vidkv"]])
def test_float32_weights_need_the_auto_reference(argv, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and "--kv-cache-dtype" in err and "must be auto" in err
    assert "'bfloat16'" in err


def test_dtype_takes_vllm_names(capsys):
    with pytest.raises(SystemExit):
        main(["--dtype", "half"])
    assert "--dtype" in capsys.readouterr().err
