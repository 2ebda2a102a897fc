"""The fhelium-opt command-line tool."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from fhelium.compile import PassError
from fhelium.ir import Program
from fhelium.tools.opt import main, parse_pipeline

ROOT = Path(__file__).resolve().parents[3]
EXAMPLE = ROOT / "examples" / "ir_allreduce.mlir"
DIVERGENT = """builtin.module {
  func.func @main(%x: tensor<4xi64>) -> tensor<4xi64> {
    %g = "fhelium.resource.ref"() {symbol = "world", kind = "process-group"} : () -> !fhelium_dist.group
    %r = "fhelium_dist.rank"(%g) : (!fhelium_dist.group) -> index
    %c0 = arith.constant 0 : index
    %root = arith.cmpi eq, %r, %c0 : index
    %out = scf.if %root -> (tensor<4xi64>) {
      %b = "fhelium_dist.broadcast"(%x, %g) {root = 0 : i64}
          : (tensor<4xi64>, !fhelium_dist.group) -> tensor<4xi64>
      scf.yield %b : tensor<4xi64>
    } else {
      scf.yield %x : tensor<4xi64>
    }
    func.return %out : tensor<4xi64>
  }
}
"""


def test_lowering_from_the_command_line_prints_parseable_ir() -> None:
    completed = subprocess.run(
        [sys.executable, "-m", "fhelium.tools.opt", str(EXAMPLE), "-p", "lower-specialized-collectives"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=60,
        check=False,
    )
    assert completed.returncode == 0, completed.stderr
    assert '"fhelium_dist.all_reduce"(%acc, %g)' in completed.stdout
    assert "all_reduce_add_ciphertext" not in completed.stdout
    Program.parse(completed.stdout)


def test_pass_options_and_notes(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([str(EXAMPLE), "-p", "lower-specialized-collectives{lower_ciphertext_add=false}"]) == 0
    captured = capsys.readouterr()
    assert "all_reduce_add_ciphertext" in captured.out
    assert "preserved for a whole-operation implementation" in captured.err


def test_error_diagnostics_set_exit_status_one(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    source = tmp_path / "divergent.mlir"
    source.write_text(DIVERGENT)
    assert main([str(source), "-p", "check-collective-uniformity"]) == 1
    assert "scf.if condition depends on rank" in capsys.readouterr().err


def test_bad_input_and_bad_pipeline_exit_with_two(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    broken = tmp_path / "broken.mlir"
    broken.write_text("builtin.module { %0 = ")
    assert main([str(broken)]) == 2
    assert "broken.mlir" in capsys.readouterr().err
    assert main([str(EXAMPLE), "-p", "no-such-pass"]) == 2
    assert "unknown pass 'no-such-pass'" in capsys.readouterr().err


def test_pipeline_spec_parsing() -> None:
    passes = parse_pipeline(
        "check-collective-uniformity, assign-implementations{fhelium_ckks.add=torch-rns-add}"
    )
    assert [p.name for p in passes] == ["check-collective-uniformity", "assign-implementations"]
    with pytest.raises(PassError, match="must look like key=value"):
        parse_pipeline("lower-specialized-collectives{oops}")
    assert parse_pipeline("") == []


def test_list_passes(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--list-passes"]) == 0
    assert "lower-specialized-collectives" in capsys.readouterr().out.split()
