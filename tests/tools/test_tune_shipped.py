import pytest

from lightllm.tools import tune_shipped


def test_variants_map_to_backend_and_kv_type():
    kw = tune_shipped._start_kwargs("m", "int4kv", 4096)
    assert (kw["llm_kv_type"], kw["llm_decode_att_backend"], kw["graph_max_len_in_batch"]) == ("int4kv", "triton", 4096)
    kw = tune_shipped._start_kwargs("m", "fa3", 32768)
    assert (kw["llm_kv_type"], kw["llm_decode_att_backend"], kw["max_req_total_len"]) == ("None", "fa3", 32768)


def test_bad_arguments_and_no_gpu(capsys, monkeypatch):
    with pytest.raises(SystemExit):
        tune_shipped.main(["--out", "x", "--graph-lens", "0"])
    assert "--graph-lens expected positive lengths, got [0]" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        tune_shipped.main(["--out", "x", "--shapes", "qwen9"])
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    assert tune_shipped.main(["--out", "x"]) == 2
    assert "tuning needs a CUDA GPU" in capsys.readouterr().err
