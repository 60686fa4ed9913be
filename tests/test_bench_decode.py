"""bench.decode's arguments (its measurement runs servers: bench/results/decode_cpu*.json)."""

import pytest

from bench.decode import main, plot, summarize


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


@pytest.mark.parametrize("value", ["-1", "1536"])
def test_ceiling_prompts_must_be_shorter_than_the_prompts(value, capsys):
    with pytest.raises(SystemExit) as e:
        main(["--ceiling-prompt-tokens", value])
    assert e.value.code == 2 and "--ceiling-prompt-tokens" in capsys.readouterr().err


def _row(dtype, rate, r, ceiling=False, prompt_tokens=4096):
    row = dict(kv_cache_dtype=dtype, decode_tokens_per_s=rate, round=r,
               prompt_tokens=prompt_tokens)
    return dict(row, ceiling=True) if ceiling else row


def test_summary_keeps_the_ceiling_rows_apart():
    rounds = [_row("auto", 40.0, 0), _row("vidkv", 50.0, 0), _row("auto", 90.0, 0, True, 16),
              _row("auto", 30.0, 1), _row("vidkv", 60.0, 1), _row("auto", 110.0, 1, True, 16)]
    got = summarize(rounds, ["auto", "vidkv"])
    assert got["median_decode_tokens_per_s"] == {"auto": 35.0, "vidkv": 55.0}
    assert got["ratio_to_reference"] == {"auto": 1.0, "vidkv": pytest.approx(55 / 35)}
    assert got["ceiling"] == dict(prompt_tokens=16, median_decode_tokens_per_s=100.0,
                                  x_ref=pytest.approx(100 / 35))
    assert "ceiling" not in summarize(rounds[:2], ["auto", "vidkv"])


def test_plot_draws_the_ceiling(tmp_path):
    rounds = [_row("auto", 40.0, 0), _row("vidkv", 50.0, 0), _row("auto", 90.0, 0, True, 16)]
    common = dict(batch=16, prompt_tokens=4096, output_tokens=400, model_dtype="float32",
                  machine=dict(cpu="a CPU", cores=2))
    plot(dict(rounds=rounds, **summarize(rounds, ["auto", "vidkv"]), **common), tmp_path / "c.png")
    plot(dict(rounds=rounds[:2], **summarize(rounds[:2], ["auto", "vidkv"]), **common),
         tmp_path / "n.png")
    assert (tmp_path / "c.png").read_bytes() != (tmp_path / "n.png").read_bytes()
