"""`trellm serve` flags: vLLM's names and defaults, the API key from the environment,
and one-line errors before the model loads."""
from __future__ import annotations

from trellm.entrypoints.cli import build_parser, main, server_config
from trellm.server.api_server import default_model_names


def test_defaults_and_flags(monkeypatch):
    monkeypatch.delenv("TRELLM_API_KEY", raising=False)
    a = build_parser().parse_args(["serve"])
    cfg = server_config(a)
    assert a.model == "" and cfg.host == "127.0.0.1" and cfg.port == 8000 and cfg.api_key is None
    a = build_parser().parse_args([
        "serve", "m.gguf", "--host", "0.0.0.0", "--port", "9000", "--served-model-name", "a", "b",
        "--max-model-len", "128", "--max-num-seqs", "2", "--max-num-batched-tokens", "64",
        "--no-enable-prefix-caching", "--long-prefill-token-threshold", "32", "--api-key", "k",
        "--max-queued-requests", "3"])
    cfg = server_config(a)
    assert (cfg.host, cfg.port, cfg.served_model_names, cfg.api_key, cfg.max_queued_requests) == (
        "0.0.0.0", 9000, ("a", "b"), "k", 3)
    assert a.max_model_len == 128 and a.max_num_seqs == 2 and a.enable_prefix_caching is False
    assert a.long_prefill_token_threshold == 32 and a.max_num_batched_tokens == 64


def test_hardening_flags():
    d = server_config(build_parser().parse_args(["serve"]))
    assert (d.allowed_hosts, d.max_queue_wait_s, d.request_header_timeout_s, d.tokenize_timeout_s) == ((), 0.0, 10.0,
                                                                                                      10.0)
    cfg = server_config(build_parser().parse_args([
        "serve", "--allowed-hosts", "api.example", "my.box", "--request-header-timeout", "3",
        "--request-body-timeout", "4", "--max-queue-wait", "20", "--tokenize-timeout", "2",
        "--allowed-origins", "http://app.example"]))
    assert cfg.allowed_hosts == ("api.example", "my.box") and cfg.allowed_origins == ("http://app.example",)
    assert (cfg.request_header_timeout_s, cfg.request_body_timeout_s, cfg.max_queue_wait_s,
            cfg.tokenize_timeout_s) == (3.0, 4.0, 20.0, 2.0)


def test_bad_hardening_flags_fail_before_loading(capsys):
    for flags in (["--max-queue-wait", "-1"], ["--request-header-timeout", "0"], ["--allowed-hosts", "a/b"]):
        assert main(["serve", "/no/such/model.gguf", *flags]) == 1
        err = capsys.readouterr().err
        assert err.startswith("trellm: error: --") and "no/such" not in err


def test_api_key_from_environment(monkeypatch):
    monkeypatch.setenv("TRELLM_API_KEY", "from-env")
    assert server_config(build_parser().parse_args(["serve"])).api_key == "from-env"
    assert server_config(build_parser().parse_args(["serve", "--api-key", "flag"])).api_key == "flag"
    monkeypatch.setenv("TRELLM_API_KEY", "")
    assert server_config(build_parser().parse_args(["serve"])).api_key is None


def test_bad_flags_fail_in_one_line_before_loading(capsys):
    assert main(["serve", "/no/such/model.gguf", "--port", "70000"]) == 1
    err = capsys.readouterr().err
    assert err.strip() == "trellm: error: --port must be in [0, 65535]"
    assert main(["serve", "/no/such/model.gguf", "--port", "0"]) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err and "no/such/model.gguf" in err


def test_default_model_name():
    assert default_model_names("") == ("SmolLM2-135M-Instruct",)
    assert default_model_names("/models/x.gguf") == ("/models/x.gguf",)
