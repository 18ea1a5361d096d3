"""One line for every user mistake (issue 45): YAML that does not parse names the file or the ``--set`` and the line
and column; a config file that is empty or not a mapping is refused naming the file; a boolean is not a number;
user code failing at run time (a reward of the wrong length or type, a custom sampler that raises) prints its last
line and where the whole traceback went (``error.log`` in the run directory), exit 1, no traceback on stderr; a
controller's parts cannot be swapped after construction; a dataset's bad byte is named by its line."""

from __future__ import annotations

import json
import re
import subprocess
import textwrap
from pathlib import Path

import pytest

from asyncrl import Controller, cli, load_config
from asyncrl.datasets import DataError
from asyncrl.tasks import build_task
from tests.test_cli import ROOT, SIMULATED, assert_clean_error, asyncrl


def one_line_error(capsys, *argv: str) -> str:
    """``asyncrl run ARGV`` through the CLI's own entry point, in this process (``cli.main`` returns what
    ``python -m asyncrl.cli`` exits with; a fresh interpreter per case costs seconds of imports): exit 2, one line on
    stderr, nothing on stdout, no traceback or pydantic boilerplate."""
    code = cli.main(["run", *argv])
    captured = capsys.readouterr()
    assert code == 2 and captured.out == "", (code, captured)
    for noise in ("Traceback", "errors.pydantic.dev", "input_value", "input_type", "[type="):
        assert noise not in captured.err, captured.err
    (line,) = captured.err.strip().splitlines()
    return line


# ------------------------------------------------------------------------------------------------------- YAML
def test_a_set_value_that_is_not_yaml_names_the_set_its_line_and_column(tmp_path, capsys):
    line = one_line_error(capsys, "quickstart", "--steps", "1", "--out", str(tmp_path / "x"),
                          "--set", "reward.funcs=[unclosed")
    assert line.startswith("asyncrl run: --set 'reward.funcs=[unclosed': the value is not valid YAML at line 1, "
                           "column "), line
    assert not (tmp_path / "x").exists()


def test_a_config_file_with_a_yaml_mistake_names_the_file_its_line_and_column(tmp_path, capsys):
    config = tmp_path / "cfg.yaml"
    config.write_text("seed: 1\nsampler:\n\tname: in_order\n")  # a tab where YAML takes spaces
    line = one_line_error(capsys, str(config), "--steps", "1", "--out", str(tmp_path / "x"))
    assert line.startswith(f"asyncrl run: config file {str(config)!r} is not valid YAML at line 3, column 1: "), line
    assert "\\t" in line or "tab" in line


@pytest.mark.parametrize("text, says", [("", "is empty"), ("# only a comment\n", "is empty"),
                                        ("- seed: 1\n- groups_per_step: 2\n", "holds a YAML list, not a mapping"),
                                        ("just words\n", "holds a YAML str, not a mapping")])
def test_a_config_file_that_is_empty_or_not_a_mapping_is_refused_naming_it(tmp_path, text, says):
    config = tmp_path / "cfg.yaml"
    config.write_text(text)
    with pytest.raises(ValueError, match=re.escape(f"config file {str(config)!r} {says}")):
        load_config(config)


def test_the_cli_refuses_an_empty_config_file_in_one_line(tmp_path, capsys):
    config = tmp_path / "empty.yaml"
    config.write_text("")
    line = one_line_error(capsys, str(config), "--steps", "1", "--out", str(tmp_path / "x"))
    assert not (tmp_path / "x").exists()
    assert line.startswith(f"asyncrl run: config file {str(config)!r} is empty"), line


def test_a_key_given_both_a_value_and_subkeys_is_one_line(tmp_path, capsys):
    line = one_line_error(capsys, "quickstart", "--steps", "1", "--out", str(tmp_path / "x"),
                          "--set", "sampler=x", "--set", "sampler.name=in_order")
    assert "--set 'sampler.name=in_order'" in line and "'sampler' is given a value by another --set" in line


# --------------------------------------------------------------------------------------------------- booleans
@pytest.mark.parametrize("overrides, key", [
    ({"groups_per_step": True}, "groups_per_step = True"),
    ({"pump_threads": True}, "pump_threads = True"),  # Literal["auto", 1, 2]: True == 1 in Python
    ({"stall_timeout_s": False}, "stall_timeout_s = False"),
    ({"generation": {"max_new_tokens": True}}, "generation.max_new_tokens = True"),
    ({"trainer": {"backend": "simulated", "lr": True}}, "trainer.lr = True"),
    ({"reward": {"timeout_s": True}}, "reward.timeout_s = True"),
])
def test_a_boolean_is_not_a_number(overrides, key):
    with pytest.raises(ValueError, match=re.escape(key) + ": a boolean where the key takes a number"):
        load_config("quickstart", **overrides)


def test_booleans_where_booleans_are_taken_still_load():
    cfg = load_config("quickstart", filter_uniform_groups=True, loss={"scale_by_std": True, "gap_metrics": False})
    assert cfg.filter_uniform_groups and cfg.loss.scale_by_std and not cfg.loss.gap_metrics


def test_set_true_for_an_integer_is_one_line_at_the_cli(tmp_path):
    proc = asyncrl("run", "quickstart", "--steps", "1", "--out", str(tmp_path / "x"), "--set", "groups_per_step=true")
    lines = assert_clean_error(proc).strip().splitlines()  # in a subprocess: as a user's shell runs it
    assert lines[1].strip().startswith("groups_per_step = True: a boolean where the key takes a number"), lines
    assert not (tmp_path / "x").exists()


# ------------------------------------------------------------------------------------------ user code at run time
def assert_failed_with_error_log(proc: subprocess.CompletedProcess, out: Path, says: str) -> str:
    assert proc.returncode == 1, (proc.returncode, proc.stderr)
    assert "Traceback" not in proc.stderr, proc.stderr
    (line,) = [line for line in proc.stderr.splitlines() if "error.log" in line]
    assert says in line and f"the full traceback is in {out / 'error.log'}" in line, line
    log = (out / "error.log").read_text()
    assert log.startswith("Traceback") and says in log.strip().splitlines()[-1]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "failed" and says in summary["error"]
    return line


@pytest.mark.parametrize("func, says", [("short", "returned 1 rewards for 8 completions"),
                                        ("words", "'yes' (str)")])
def test_a_reward_of_the_wrong_length_or_type_is_one_line_and_error_log(tmp_path, func, says):
    out = tmp_path / "run"
    proc = asyncrl("run", "quickstart", "--steps", "2", "--out", str(out), "--quiet", "--no-plot",
                   "--set", "eval_every=null", "--set", f"reward.funcs=[tests.reward_functions:{func}]",
                   env={"PYTHONPATH": str(ROOT)})
    assert_failed_with_error_log(proc, out, says)


def test_a_custom_sampler_that_raises_is_one_line_and_error_log(tmp_path):
    (tmp_path / "raising_sampler.py").write_text(textwrap.dedent("""
        from tests.custom_sampler_fixture import NewestFirstSampler

        class Raising(NewestFirstSampler):
            def _candidates(self, T):
                if T >= 1:
                    raise RuntimeError("my sampler broke at T=1")
                yield from super()._candidates(T)
    """))
    out = tmp_path / "run"
    proc = asyncrl("run", "quickstart", "--steps", "4", "--out", str(out), "--quiet", "--no-plot", *SIMULATED,
                   "--set", "sampler.name=custom", "--set", "sampler.target=raising_sampler:Raising",
                   env={"PYTHONPATH": f"{ROOT}:{tmp_path}"})
    line = assert_failed_with_error_log(proc, out, "RuntimeError: my sampler broke at T=1")
    assert line.startswith("asyncrl run: failed: RuntimeError: my sampler broke at T=1")
    assert "_candidates" in (out / "error.log").read_text()  # where it broke, in the user's code


# ----------------------------------------------------------------------------------------- a controller's parts
@pytest.mark.parametrize("part", ["policy", "generator", "task", "sampler", "buffer"])
def test_a_controllers_parts_are_fixed_at_construction(part):
    ctrl = Controller.from_config(load_config("quickstart", generation={"backend": "simulated"},
                                              trainer={"backend": "simulated"}))
    before = getattr(ctrl, part)
    with pytest.raises(AttributeError) as info:
        setattr(ctrl, part, object())
    message = str(info.value)
    assert "\n" not in message and "Controller(" in message and part in message, message
    with pytest.raises(AttributeError, match=r"Controller\("):
        delattr(ctrl, part)
    assert getattr(ctrl, part) is before
    ctrl.tick()  # still the controller it was
    ctrl.close()


# ------------------------------------------------------------------------------------------------- datasets
@pytest.mark.parametrize("suffix, text, where", [
    (".jsonl", b'{"prompt": "2+2=", "answer": "4"}\n\n{"prompt": "3+\xff", "answer": "5"}\n', "line 3 (row 1)"),
    (".csv", b"prompt,answer\n2+2=,4\n3+\xff,5\n", "line 3 (row 1)"),
    (".json", b'[{"prompt": "2+2=", "answer": "4"},\n {"prompt": "3+\xff", "answer": "5"}]\n', "line 2"),
])
def test_a_byte_that_is_not_utf8_is_named_by_its_line(tmp_path, suffix, text, where):
    path = tmp_path / f"data{suffix}"
    path.write_bytes(text)
    with pytest.raises(DataError) as info:
        build_task({"name": "dataset", "options": {"train": str(path)}})
    message = str(info.value)
    assert "\n" not in message and f"{str(path)!r} {where}: not UTF-8 text (byte 0xff at column" in message, message


def test_the_columns_a_reward_misses_are_listed_with_the_prompt_column(tmp_path):
    path = tmp_path / "data.jsonl"
    path.write_text('{"question": "2+2=", "level": 1}\n')

    def needs_solution(completions, solution, **kwargs):
        return [0.0] * len(completions)

    cfg = load_config("quickstart", generation={"backend": "simulated"}, trainer={"backend": "simulated"},
                      task={"name": "dataset", "options": {"train": str(path), "prompt_key": "question"}})
    with pytest.raises(ValueError, match=re.escape("its columns are ['level', 'question']")):
        Controller.from_config(cfg, reward_funcs=[needs_solution])


# ------------------------------------------------------------------------------------------------ environments
class ResetRaises:
    """A text environment whose every ``reset`` raises: every group is given up, none ever commits."""

    def reset(self, **row):
        raise RuntimeError("no such secret column")

    def step(self, action: str):
        return None, 0.0, True


def test_a_run_whose_environment_always_fails_stalls_naming_the_environment_s_error():
    """Every group skipped after its fault rows: the stall says so and names the last reason, so the user reads
    the environment's error in the run's one line (not only a count of pending groups)."""
    from asyncrl.run_loop import StallError

    # One dispatch per group and a 6 s stall: on a loaded 2-core machine the first rollout tick alone took over 3 s,
    # so a 3 s stall fired before any group had been given up (a CI failure, not a behaviour change).
    cfg = load_config("guess_letter", groups_per_step=2, group_size=2, eval_every=None, stall_timeout_s=6,
                      environment={"workers": 1}, faults={"max_dispatch_attempts": 1})
    ctrl = Controller.from_config(cfg, environment_factory=ResetRaises)
    with pytest.raises(StallError) as err:
        ctrl.run(1, progress=False)
    first = str(err.value).splitlines()[0]
    assert re.search(r"\d+ groups skipped since the last commit; the last: environment: ResetRaises.reset raised "
                     r"RuntimeError: no such secret column", first), first


def test_an_environment_instance_or_a_factory_string_in_python_is_one_line_saying_what_to_pass():
    cfg = load_config("quickstart", groups_per_step=2, group_size=2, eval_every=None)
    with pytest.raises(ValueError, match=r"^environment_factory must be a class, got an instance of ResetRaises "
                                         r"\(pass the class: one instance is made per trajectory\)$"):
        Controller.from_config(cfg, environment_factory=ResetRaises())
    with pytest.raises(ValueError, match=r"^environment_factory must be a class, got the string 'm:C' \(that form is "
                                         r"the config's environment.factory\)$"):
        Controller.from_config(cfg, environment_factory="m:C")
