"""The everyday CLI, through Typer's runner and as real subprocesses."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from localllm.cli import app
from localllm.config.settings import load_settings
from localllm.serving.service import service_plan, systemd_unit

runner = CliRunner()


def _env(tmp_path, **extra) -> dict:
    env = {**os.environ, "LOCALLLM_HOME": str(tmp_path), "LOCALLLM_PORT": "1", **extra}
    return env


# A question SmolLM2 answers with a clear margin ("What is the capital of France?" is a near-tie:
# "The" over "L" by 0.08 nats; at llama.cpp's precision, localllm's default, it starts "L'Étoile",
# as llama.cpp does).
QUESTION, ANSWER = "What is the capital of Germany?", "Berlin"


def test_run_one_shot_subprocess(smollm2_path, tmp_path):
    res = subprocess.run(
        [sys.executable, "-m", "localllm.cli", "run", str(smollm2_path), QUESTION, "--max-tokens", "12"],
        capture_output=True, text=True, timeout=300, env=_env(tmp_path),
    )
    assert res.returncode == 0, res.stderr
    assert ANSWER in res.stdout


def test_run_reads_the_prompt_from_stdin(smollm2_path, tmp_path):
    res = subprocess.run(
        [sys.executable, "-m", "localllm.cli", "run", str(smollm2_path), "--max-tokens", "12"],
        input=QUESTION, capture_output=True, text=True, timeout=300, env=_env(tmp_path),
    )
    assert res.returncode == 0, res.stderr
    assert ANSWER in res.stdout


def test_repl_commands(smollm2_path, tmp_path):
    script = '/help\n"""\nWhat is\nthe capital of France?\n"""\n/system Answer in French.\n/clear\n/bogus\n/bye\n'
    res = subprocess.run(
        [sys.executable, "-c", "import sys; from localllm.cli.run import _repl, _load_llm; from localllm import "
         "SamplingParams; llm=_load_llm(sys.argv[1], 'float32', None, '128MiB'); "
         "_repl(llm, SamplingParams(max_tokens=10, temperature=0.0), None)", str(smollm2_path)],
        input=script, capture_output=True, text=True, timeout=300, env=_env(tmp_path),
    )
    assert res.returncode == 0, res.stderr
    assert "/bye" in res.stdout  # the help text
    assert "Set the system prompt." in res.stderr
    assert "Cleared the conversation." in res.stderr
    assert "Unknown command /bogus" in res.stderr
    # the three-line message went out as one message and got one streamed reply
    reply = res.stdout.split('... ... ... ', 1)[1].split('\n', 1)[0]
    assert reply.strip()


def test_repl_format_json(smollm2_path, tmp_path):
    script = "/format yaml\n/format json\nDescribe a cat.\n/format text\n/bye\n"
    res = subprocess.run(
        [sys.executable, "-c", "import sys; from localllm.cli.run import _repl, _load_llm; from localllm import "
         "SamplingParams; llm=_load_llm(sys.argv[1], 'float32', None, '128MiB'); "
         "_repl(llm, SamplingParams(max_tokens=120, temperature=0.0), None)", str(smollm2_path)],
        input=script, capture_output=True, text=True, timeout=300, env=_env(tmp_path),
    )
    assert res.returncode == 0, res.stderr
    assert "Usage: /format json" in res.stderr and "Answers are JSON objects now." in res.stderr
    assert "Answers are free text now." in res.stderr
    reply = res.stdout.split(">>> ")[3].split("\n")[0]  # prompts 1-2 are commands, the reply follows the third
    assert isinstance(json.loads(reply), dict), reply


def test_unknown_model_is_one_readable_line(tmp_path, monkeypatch):
    monkeypatch.setenv("LOCALLLM_HOME", str(tmp_path))
    monkeypatch.setenv("LOCALLLM_PORT", "1")
    res = runner.invoke(app, ["run", "smollm9:135m", "hi"])
    assert res.exit_code == 1
    lines = [line for line in res.output.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("Error:") and "smollm2" in lines[0]


def test_config_precedence(tmp_path, monkeypatch):
    monkeypatch.setenv("LOCALLLM_HOME", str(tmp_path))
    (tmp_path / "config.toml").write_text('port = 9000\nmax_num_seqs = 8\nbatching = "static"\n')
    monkeypatch.setenv("LOCALLLM_MAX_NUM_SEQS", "4")
    s = load_settings({"batching": "continuous", "port": None})
    assert (s.port, s.sources["port"]) == (9000, "config.toml")
    assert (s.max_num_seqs, s.sources["max_num_seqs"]) == (4, "env")
    assert (s.batching, s.sources["batching"]) == ("continuous", "flag")
    res = runner.invoke(app, ["config"])
    assert res.exit_code == 0
    assert "port = 9000  (config.toml)" in res.output
    assert "max_num_seqs = 4  (env)" in res.output


def test_bad_config_is_one_line(tmp_path, monkeypatch):
    monkeypatch.setenv("LOCALLLM_HOME", str(tmp_path))
    (tmp_path / "config.toml").write_text("port = 'many'\n")
    res = runner.invoke(app, ["config"])
    assert res.exit_code == 1 and "port" in res.output and "not a valid int" in res.output


def test_systemd_unit_content(tmp_path, monkeypatch):
    monkeypatch.setenv("LOCALLLM_HOME", str(tmp_path))
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))
    unit = systemd_unit("smollm2:135m", "127.0.0.1", 11435)
    assert "[Service]" in unit and "[Install]" in unit and "WantedBy=default.target" in unit
    exec_line = next(line for line in unit.splitlines() if line.startswith("ExecStart="))
    assert exec_line.endswith("serve smollm2:135m --host 127.0.0.1 --port 11435")
    assert f"Environment=LOCALLLM_HOME={tmp_path}" in unit
    plan = service_plan("smollm2:135m", "127.0.0.1", 11435, platform="linux")
    assert plan.path == tmp_path / "xdg" / "systemd" / "user" / "localllm.serving.service"
    assert ["systemctl", "--user", "enable", "--now", "localllm.serving.service"] in plan.commands
    mac = service_plan("smollm2:135m", "127.0.0.1", 11435, platform="darwin")
    assert mac.path.name == "dev.localllm.server.plist" and "<key>RunAtLoad</key><true/>" in mac.content
    other = service_plan("smollm2:135m", "127.0.0.1", 11435, platform="win32")
    assert other.path is None and "serve smollm2:135m" in other.content
    res = runner.invoke(app, ["service", "install", "--dry-run"])
    assert res.exit_code == 0 and "would write" in res.output


def test_stop_and_ps_without_a_server(tmp_path, monkeypatch):
    monkeypatch.setenv("LOCALLLM_HOME", str(tmp_path))
    monkeypatch.setenv("LOCALLLM_PORT", "1")
    assert "No detached" in runner.invoke(app, ["stop"]).output
    assert "No localllm server" in runner.invoke(app, ["ps"]).output


def test_bench_command(smollm2_path, tmp_path, monkeypatch):
    monkeypatch.setenv("LOCALLLM_HOME", str(tmp_path))
    res = runner.invoke(app, ["bench", str(smollm2_path), "--prompt-tokens", "32", "--tokens", "4"])
    assert res.exit_code == 0, res.output
    assert "prefill (32 tokens):" in res.output and "decode  (4 tokens, 1 stream):" in res.output


@pytest.mark.parametrize("cmd", [[], ["run"], ["bench"], ["pull"], ["list"], ["show"], ["rm"], ["ps"], ["stop"], ["config"],
                                 ["service"]])
def test_help_everywhere(cmd):
    res = runner.invoke(app, [*cmd, "--help"])
    assert res.exit_code == 0 and "Usage" in res.output
