"""load_config: file discovery, overlays, and errors that name file, line and key path."""

from __future__ import annotations

from pathlib import Path

import pytest

from flodld.config import (
    AveragingMode,
    ConfigError,
    ConfigNotFoundError,
    available_envs,
    load_config,
    load_text,
)
from flodld.config.yamlsource import MAX_FILE_BYTES

from .helpers import load_issues, only_issue, write

BASE = """
cluster:
  controller:
    host: 10.0.0.1
    averaging: cpu_sync
    join:
      join_timeout: 30
  workers:
    - host: node-a
      local_devices: [0]
      path: /srv/a
  env:
    A: "1"
join:
  address: 10.0.0.1
  program: train.py
"""


def test_base_file_loads_into_the_model(tmp_path: Path) -> None:
    write(tmp_path, "fdl.yml", BASE)
    config = load_config(tmp_path)
    assert config.cluster is not None and config.join is not None
    assert config.cluster.controller.port == 1337
    assert config.cluster.controller.join.join_timeout == 30
    assert config.cluster.workers[0].local_devices == ("cuda:0",)
    assert config.join.controller_endpoint() == ("10.0.0.1", 1337)


def test_empty_file_is_an_empty_project(tmp_path: Path) -> None:
    write(tmp_path, "fdl.yml", "# nothing yet\n")
    config = load_config(tmp_path)
    assert config.cluster is None and config.join is None


def test_missing_config_raises_config_not_found(tmp_path: Path) -> None:
    with pytest.raises(ConfigNotFoundError, match=r"no fdl\.yml"):
        load_config(tmp_path)


def test_overlay_deep_merges_mappings_and_replaces_lists(tmp_path: Path) -> None:
    write(tmp_path, "fdl.yml", BASE)
    write(
        tmp_path,
        "fdl.cluster.yml",
        """
        cluster:
          controller:
            averaging: cpu_cadence
            join:
              target_ranks: 3
          workers:
            - host: node-b
              local_devices: ["cpu:2"]
              path: /srv/b
          env:
            B: "2"
        """,
    )
    cluster = load_config(tmp_path, "cluster").cluster
    assert cluster is not None
    assert cluster.controller.host == "10.0.0.1"
    assert cluster.controller.averaging is AveragingMode.CPU_CADENCE
    assert cluster.controller.join.join_timeout == 30
    assert cluster.controller.join.target_ranks == 3
    assert [worker.host for worker in cluster.workers] == ["node-b"]
    assert cluster.env == {"A": "1", "B": "2"}


def test_overlay_null_removes_a_key_so_the_default_applies(tmp_path: Path) -> None:
    write(tmp_path, "fdl.yml", BASE)
    write(tmp_path, "fdl.dev.yml", "cluster:\n  controller:\n    join: null\njoin: null\n")
    config = load_config(tmp_path, "dev")
    assert config.join is None
    assert config.cluster is not None and config.cluster.controller.join.join_timeout == 300


def test_overlay_alone_works_without_a_base_file(tmp_path: Path) -> None:
    write(tmp_path, "fdl.solo.yml", "join:\n  program: x.py\n")
    config = load_config(tmp_path, "solo")
    assert config.join is not None and config.join.program == "x.py"


def test_unknown_env_lists_the_available_overlays(tmp_path: Path) -> None:
    write(tmp_path, "fdl.yml", BASE)
    write(tmp_path, "fdl.cluster.yml", "{}\n")
    write(tmp_path, "fdl.gpu-farm.yml", "{}\n")
    issue = only_issue(tmp_path, "clutser")
    assert "unknown environment 'clutser'" in issue.message
    assert "available: cluster, gpu-farm" in issue.message
    assert available_envs(tmp_path) == ["cluster", "gpu-farm"]


def test_unknown_env_without_overlays_says_so(tmp_path: Path) -> None:
    write(tmp_path, "fdl.yml", BASE)
    assert "none" in only_issue(tmp_path, "cluster").message
    assert "invalid" in only_issue(tmp_path, "../etc").message


def test_available_envs_ignores_unrelated_files(tmp_path: Path) -> None:
    for name in ("fdl.yml", "fdl.a.b.yml", "fdl..yml", "other.x.yml", "fdl.x.yaml", "fdl.ok.yml"):
        write(tmp_path, name, "{}\n")
    assert available_envs(tmp_path) == ["ok"]
    assert available_envs(tmp_path / "missing") == []


def test_unknown_key_names_file_line_and_suggests_the_close_key(tmp_path: Path) -> None:
    path = write(tmp_path, "fdl.yml", BASE.replace("    averaging: cpu_sync", "    averagng: cpu_sync"))
    issue = only_issue(tmp_path)
    assert (issue.file, issue.line, issue.column) == (path, 4, 5)
    assert issue.key_path == ("cluster", "controller", "averagng")
    assert "did you mean 'averaging'?" in issue.message
    assert str(issue).startswith(f"{path}:4:5: cluster.controller.averagng: unknown key")


def test_unknown_key_inside_the_join_window_block_is_located(tmp_path: Path) -> None:
    write(tmp_path, "fdl.yml", BASE.replace("join_timeout: 30", "join_timeot: 30"))
    issue = only_issue(tmp_path)
    assert issue.line == 6 and issue.key_path == ("cluster", "controller", "join", "join_timeot")
    assert "did you mean 'join_timeout'?" in issue.message


def test_renamed_key_hint_for_walk_in_block(tmp_path: Path) -> None:
    write(tmp_path, "fdl.yml", "join:\n  controller: 10.0.0.1\n")
    assert "did you mean 'address'?" in only_issue(tmp_path).message


GOLDEN_IMAGE_JOIN = """\
join:
  ssh:
    target: ctrl.example.com
    user: flodl-join
    identity_file: /etc/flodl/join_key
  bin: target/release/train
  args: ["--model", "resnet"]
  persist: true
"""


def test_the_golden_image_join_block_loads_with_bin_as_program(tmp_path: Path) -> None:
    write(tmp_path, "fdl.yml", GOLDEN_IMAGE_JOIN)
    join = load_config(tmp_path).join
    assert join is not None and join.program == "target/release/train"
    assert join.args == ("--model", "resnet") and join.persist
    assert join.ssh is not None and join.ssh.target == "ctrl.example.com" and join.ssh.user == "flodl-join"


def test_bin_and_program_together_are_refused_at_bin(tmp_path: Path) -> None:
    write(tmp_path, "fdl.yml", "join:\n  program: a.py\n  bin: b.py\n")
    issue = only_issue(tmp_path)
    assert issue.key_path == ("join", "bin") and issue.line == 3
    assert "keep one of them" in issue.message


def test_a_bad_bin_value_is_located_at_bin(tmp_path: Path) -> None:
    write(tmp_path, "fdl.yml", "join:\n  bin: [1]\n")
    issue = only_issue(tmp_path)
    assert issue.key_path == ("join", "bin") and "valid string" in issue.message


def test_unknown_top_level_key_lists_allowed_keys(tmp_path: Path) -> None:
    write(tmp_path, "fdl.yml", "clusters: {}\n")
    issue = only_issue(tmp_path)
    assert issue.line == 1 and "did you mean 'cluster'?" in issue.message
    assert "allowed here: cluster, join" in issue.message


def test_bad_enum_value_names_what_is_allowed(tmp_path: Path) -> None:
    write(tmp_path, "fdl.yml", BASE.replace("averaging: cpu_sync", "averaging: fast"))
    issue = only_issue(tmp_path)
    assert issue.line == 4 and "'cpu_sync'" in issue.message and "'fast'" in issue.message


def test_bad_list_item_points_at_its_own_line(tmp_path: Path) -> None:
    text = BASE.replace("      local_devices: [0]", "      local_devices:\n        - 0\n        - gpu")
    write(tmp_path, "fdl.yml", text)
    issue = only_issue(tmp_path)
    assert issue.key_path == ("cluster", "workers", 0, "local_devices", 1)
    assert issue.line == 11


def test_missing_required_key_points_at_its_parent(tmp_path: Path) -> None:
    write(tmp_path, "fdl.yml", BASE.replace("    host: 10.0.0.1\n", ""))
    issue = only_issue(tmp_path)
    assert issue.key_path == ("cluster", "controller", "host")
    assert issue.line == 2 and "missing required key 'host'" in issue.message


def test_rule_violation_is_located_at_the_key_to_change(tmp_path: Path) -> None:
    text = BASE.replace("  env:\n", "    - host: node-a\n      local_devices: [1]\n      path: /x\n  env:\n")
    write(tmp_path, "fdl.yml", text)
    issue = only_issue(tmp_path)
    assert issue.key_path == ("cluster", "workers", 1, "host")
    assert issue.line == 11 and "already workers[0]" in issue.message


def test_errors_in_an_overlay_name_the_overlay_file(tmp_path: Path) -> None:
    write(tmp_path, "fdl.yml", BASE)
    overlay = write(tmp_path, "fdl.cluster.yml", "cluster:\n  controller:\n    port: 99999\n")
    issue = only_issue(tmp_path, "cluster")
    assert (issue.file, issue.line) == (overlay, 3)
    assert issue.key_path == ("cluster", "controller", "port")


def test_base_keys_keep_base_positions_after_merge(tmp_path: Path) -> None:
    base = write(tmp_path, "fdl.yml", BASE.replace("path: /srv/a", "path: ''"))
    write(tmp_path, "fdl.cluster.yml", "cluster:\n  controller:\n    port: 1400\n")
    issue = only_issue(tmp_path, "cluster")
    assert (issue.file, issue.line) == (base, 10)
    assert "must not be empty" in issue.message


def test_several_problems_are_reported_together_in_line_order(tmp_path: Path) -> None:
    write(
        tmp_path, "fdl.yml", "cluster:\n  controller:\n    host: 'a b'\n    port: x\njoin:\n  persist: yes\n"
    )
    issues = load_issues(tmp_path)
    assert [issue.line for issue in issues] == [3, 4, 6]
    assert "without spaces" in issues[0].message
    assert "valid integer" in issues[1].message and "'x'" in issues[1].message
    assert "valid boolean" in issues[2].message


def test_yaml_syntax_error_has_file_and_line(tmp_path: Path) -> None:
    path = write(tmp_path, "fdl.yml", "cluster:\n  controller: [1, 2\n  workers: []\n")
    issue = only_issue(tmp_path)
    assert issue.file == path and issue.line is not None and issue.line >= 2
    assert "YAML syntax error" in issue.message


def test_duplicate_yaml_keys_are_errors(tmp_path: Path) -> None:
    write(tmp_path, "fdl.yml", "join:\n  program: a\n  program: b\n")
    issue = only_issue(tmp_path)
    assert issue.line == 3 and "program" in issue.message


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("- a\n- b\n", "must be a mapping"),
        ("just text\n", "must be a mapping"),
        ("1: x\n", "keys must be strings"),
        ("join: !custom x\n", "tags are not allowed"),
    ],
)
def test_malformed_documents_become_config_errors(tmp_path: Path, text: str, fragment: str) -> None:
    write(tmp_path, "fdl.yml", text)
    assert fragment in only_issue(tmp_path).message


def test_alias_bombs_are_capped(tmp_path: Path) -> None:
    lines = ["a0: &a0 [x, x, x, x, x, x, x, x, x, x]"]
    lines += [f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * 10) + "]" for i in range(1, 6)]
    write(tmp_path, "fdl.yml", "\n".join(lines) + "\n")
    assert "more than" in only_issue(tmp_path).message


def test_oversized_files_are_refused_before_reading(tmp_path: Path) -> None:
    write(tmp_path, "fdl.yml", "#" * (MAX_FILE_BYTES + 1))
    assert "capped" in only_issue(tmp_path).message


def test_undecodable_file_is_a_config_error(tmp_path: Path) -> None:
    (tmp_path / "fdl.yml").write_bytes(b"join:\n  program: \xff\xfe\n")
    assert "cannot read" in only_issue(tmp_path).message


def test_walk_in_block_rules(tmp_path: Path) -> None:
    write(tmp_path, "fdl.yml", "join:\n  ssh:\n    user: me\n")
    issue = only_issue(tmp_path)
    assert issue.key_path == ("join", "ssh", "target") and issue.line == 2
    config = load_text("join:\n  address: '[::1]:2000'\n  token: ' 00112233445566778899AABBCCDDEEFF '\n")
    assert config.join is not None
    assert config.join.controller_endpoint() == ("::1", 2000)
    assert config.join.token == "00112233445566778899aabbccddeeff"
    for bad in ("'h:0'", "'h:x'", "'[::1'", "'a b'", "'[::1]x'"):
        with pytest.raises(ConfigError, match=r"join\.address"):
            load_text(f"join:\n  address: {bad}\n")


def test_walk_in_block_defaults(tmp_path: Path) -> None:
    config = load_text("join: {}\n")
    assert config.join is not None
    assert config.join.controller_endpoint() == ("127.0.0.1", 1337)
    assert config.join.devices == "all" and config.join.persist is False and config.join.args == ()


def test_examples_load() -> None:
    examples = Path(__file__).resolve().parents[3] / "examples"
    base = load_config(examples)
    cluster = load_config(examples, "cluster")
    assert base.cluster is not None and cluster.cluster is not None
    assert cluster.cluster.hosts_to_probe == ("node-b",)
    assert cluster.cluster.controller.backend == base.cluster.controller.backend


def test_keys_from_other_tools_get_specific_hints(tmp_path: Path) -> None:
    write(
        tmp_path, "fdl.yml", BASE.replace("      local_devices: [0]", "      devices: [0]\n      ranks: [0]")
    )
    messages = [issue.message for issue in load_issues(tmp_path)]
    assert any("did you mean 'local_devices'?" in message for message in messages)
    assert any("ranks are assigned at admission" in message for message in messages)


def test_a_straggler_timeout_under_cpu_sync_is_refused_naming_the_yaml_fix(tmp_path: Path) -> None:
    timeout = "\n    straggler_timeout: 5\n"
    write(tmp_path, "fdl.yml", BASE.replace("averaging: cpu_sync\n", "averaging: cpu_sync" + timeout))
    issue = only_issue(tmp_path)
    assert "straggler_timeout applies to cpu_cadence and cpu_async, not cpu_sync" in issue.message
    assert "remove straggler_timeout, or choose averaging: cpu_cadence" in issue.message
    write(tmp_path, "fdl.yml", BASE.replace("averaging: cpu_sync\n", "averaging: cpu_cadence" + timeout))
    cluster = load_config(tmp_path).cluster
    assert cluster is not None and cluster.controller.straggler_timeout == 5
