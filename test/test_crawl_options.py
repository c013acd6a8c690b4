"""``python -m url_lists crawl``'s command line: img2dataset's option names, and bad input refused
with one line and a non-zero exit before anything starts (no server, no run file)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from url_lists.__main__ import main
from url_lists.crawl import checks
from url_lists.crawl.local import crawler_env, processes_env, user_agent
from url_lists.crawl.options import IGNORED, OptionError, parse
from common.settings import DEFAULT_USER_AGENT

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def parquet_list(tmp_path: Path) -> Path:
    path = tmp_path / "list.parquet"
    pq.write_table(pa.table({"URL": ["http://a.test/1.jpg"], "TEXT": ["one"], "WIDTH": [10]}), path)
    return path


def test_img2dataset_s_spellings_all_read_alike(parquet_list: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    options = parse(["--url_list", str(parquet_list), "--output-folder", str(out), "--input_format=parquet",
                     "--url_col", "URL", "--caption-col", "TEXT", "--save_additional_columns", '["WIDTH"]',
                     "--output_format", "webdataset", "--number_sample_per_shard", "100", "--image_size", "384",
                     "--processes_count", "3", "--user_agent_token", "my-dataset", "--incremental_mode",
                     "overwrite", "--resize_mode", "keep_ratio_largest", "--resize_only_if_bigger",
                     "--encode_quality", "85", "--encode_format", "jpg"])
    assert options.url_list == (str(parquet_list),) and options.output_folder == out
    assert (options.input_format, options.url_col, options.caption_col) == ("parquet", "URL", "TEXT")
    assert options.save_additional_columns == ("WIDTH",)
    assert (options.output_format, options.number_sample_per_shard, options.image_size) == ("webdataset", 100, 384)
    assert (options.processes_count, options.user_agent_token, options.incremental_mode) == (3, "my-dataset",
                                                                                            "overwrite")
    assert options.warnings == ()


def test_positional_lists_and_img2dataset_s_defaults(tmp_path: Path) -> None:
    options = parse(["a.txt", "b/*.txt", "--save_additional_columns", "x, y"])
    assert options.url_list == ("a.txt", "b/*.txt") and options.save_additional_columns == ("x", "y")
    assert (options.output_format, options.image_size, options.number_sample_per_shard) == ("files", 256, 10_000)
    assert (options.output_folder, options.processes_count, options.incremental_mode) == (Path("images"), 1,
                                                                                        "incremental")


@pytest.mark.parametrize("name", sorted(IGNORED))
def test_an_option_with_no_meaning_here_is_accepted_with_one_warning(name: str) -> None:
    options = parse(["list.txt", f"--{name}", "7"])
    assert len(options.warnings) == 1 and f"--{name}" in options.warnings[0]


@pytest.mark.parametrize("argv, named", [
    (["--resize_mode", "border"], "--resize_mode"),
    (["--resize_only_if_bigger", "False"], "--resize_only_if_bigger"),
    (["--encode_format", "webp"], "--encode_format"),
    (["--encode_quality", "95"], "--encode_quality"),
    (["--skip_reencode", "True"], "--skip_reencode"),
    (["--min_image_size", "100"], "--min_image_size"),
    (["--bbox_col", "box"], "--bbox_col"),
    (["--verify_hash", '["sha256", "sha256"]'], "--verify_hash"),
    (["--incremental_mode", "extend"], "--incremental_mode"),
    (["--output_format", "tfrecord"], "--output_format"),
    (["--input_format", "txt.gz"], "--input_format"),
    (["--image_size", "5"], "--image_size"),
    (["--image_size", "big"], "--image_size"),
    (["--number_sample_per_shard", "0"], "--number_sample_per_shard"),
    (["--no_such_option", "1"], "--no_such_option"),
    (["--save_additional_columns", "url"], "url"),
])
def test_an_option_that_would_change_results_is_refused_naming_it(argv: list[str], named: str) -> None:
    with pytest.raises(OptionError, match=named.replace("[", r"\[")):
        parse(["list.txt", *argv])


def _refused(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    assert main(["crawl", *argv]) == 2
    out, err = capsys.readouterr()
    assert out == "" and len(err.strip().splitlines()) == 1 and err.startswith("error: "), err
    return err


def test_bad_input_is_one_line_and_exit_2_before_anything_starts(tmp_path: Path, parquet_list: Path,
                                                                  capsys: pytest.CaptureFixture[str],
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("KAFKA_HOSTS", "REDIS_URL", "S3_ENDPOINT_URL", "S3_BUCKET"):
        monkeypatch.delenv(name, raising=False)
    out = tmp_path / "out"
    assert "missing.parquet" in _refused(["--url_list", str(tmp_path / "missing.parquet"),
                                          "--output_folder", str(out)], capsys)
    (tmp_path / "list.xml").write_text("<urls/>")
    assert "--input-format" in _refused(["--url_list", str(tmp_path / "list.xml"), "--output_folder", str(out)],
                                        capsys)
    assert "no column url" in _refused(["--url_list", str(parquet_list), "--output_folder", str(out)], capsys)
    assert "no column CAPTION" in _refused(["--url_list", str(parquet_list), "--url_col", "URL",
                                            "--caption_col", "CAPTION", "--output_folder", str(out)], capsys)
    csv_list = tmp_path / "list.csv"
    csv_list.write_text("link,caption\nhttp://a.test/1.jpg,one\n")
    assert "no column url" in _refused(["--url_list", str(csv_list), "--output_folder", str(out)], capsys)
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    assert "cannot write" in _refused(["--url_list", str(parquet_list), "--url_col", "URL",
                                       "--output_folder", str(blocker / "out")], capsys)
    assert "--resize_mode" in _refused(["--url_list", str(parquet_list), "--url_col", "URL", "--output_folder",
                                        str(out), "--resize_mode", "center_crop"], capsys)
    monkeypatch.setenv("KAFKA_HOSTS", "127.0.0.1:1")
    assert "REDIS_URL" in _refused(["--url_list", str(parquet_list), "--url_col", "URL",
                                    "--output_folder", str(out)], capsys)
    assert not (out / checks.CRAWL_DIR).exists()  # nothing was started, no run recorded


def test_a_folder_with_someone_else_s_files_or_another_crawl_s_options_is_refused(
        tmp_path: Path, parquet_list: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("KAFKA_HOSTS", "REDIS_URL", "S3_ENDPOINT_URL", "S3_BUCKET"):
        monkeypatch.delenv(name, raising=False)
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    (theirs / "notes.txt").write_text("mine")
    base = ["--url_list", str(parquet_list), "--url_col", "URL"]
    assert "not a crawl's" in _refused([*base, "--output_folder", str(theirs)], capsys)
    assert "not a crawl's" in _refused([*base, "--output_folder", str(theirs), "--incremental_mode", "overwrite"],
                                       capsys)
    ours = tmp_path / "ours"
    options = parse([*base, "--output_folder", str(ours), "--output_format", "parquet"])
    started = checks.start_run(options, [parquet_list], lambda: __import__("uuid").uuid4())
    saved = json.loads(checks.run_file(ours).read_text())
    assert saved["run"] == str(started.run) and saved["options"]["output_format"] == "parquet"
    assert "output_format" in _refused([*base, "--output_folder", str(ours), "--output_format", "webdataset"], capsys)
    assert checks.existing_run(options, [parquet_list]) == started.run  # the same command resumes it
    again = parse([*base, "--output_folder", str(ours), "--incremental_mode", "overwrite"])
    (ours / "00000.tar").write_text("old")
    renewed = checks.start_run(again, [parquet_list], lambda: __import__("uuid").uuid4())
    assert renewed.run != started.run and not renewed.resumed and not (ours / "00000.tar").exists()


def test_the_user_agent_token_is_appended_and_the_image_size_is_the_workers_resolution(tmp_path: Path) -> None:
    assert user_agent({}, "my-dataset") == f"{DEFAULT_USER_AGENT} my-dataset"
    assert user_agent({"CRAWL_USER_AGENT": "bot/2 (+x)"}, None) == "bot/2 (+x)"
    env = crawler_env(parse(["l.txt", "--image_size", "384", "--user_agent_token", "t"]), {}, tmp_path)
    assert env["TARGET_RESOLUTION"] == "384" and env["CRAWL_USER_AGENT"].endswith(" t")
    assert json.loads(Path(env["SOURCES_URL"]).read_text()) == []  # no Openverse lookup from a dev box


@pytest.mark.parametrize("shell, wanted", [
    ({}, {"LISTEN_HOST": "127.0.0.1", "KAFKA_SESSION_TIMEOUT_MS": "2000"}),        # the stack's
    ({"LISTEN_HOST": "0.0.0.0", "KAFKA_SESSION_TIMEOUT_MS": "6000"},                 # the user's own
     {"LISTEN_HOST": "0.0.0.0", "KAFKA_SESSION_TIMEOUT_MS": "6000"}),
    ({"REDIS_URL": "redis://elsewhere:6379", "TARGET_RESOLUTION": "64", "THUMBNAIL_DIR": "/x"},
     {"REDIS_URL": "redis://127.0.0.1:7000", "TARGET_RESOLUTION": "384"}),          # never over the stack's or ours
])
def test_the_embedded_processes_take_the_users_settings_but_never_over_the_stacks_addresses(
        shell: dict[str, str], wanted: dict[str, str], tmp_path: Path) -> None:
    env = processes_env(shell, {"REDIS_URL": "redis://127.0.0.1:7000", "KAFKA_HOSTS": "127.0.0.1:7001"},
                        {"TARGET_RESOLUTION": "384"}, 7002, tmp_path / "thumbnails")
    assert {name: env[name] for name in wanted} == wanted
    assert env["THUMBNAIL_DIR"] == str((tmp_path / "thumbnails").resolve()) and env["MONITOR_PORT"] == "7002"


def test_the_module_refuses_a_missing_list_in_one_line() -> None:
    done = subprocess.run([sys.executable, "-m", "url_lists", "crawl", "--url_list", "/nonexistent/list.parquet"],
                          cwd=ROOT, capture_output=True, text=True, timeout=60,
                          env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT)})
    assert done.returncode == 2 and done.stderr.strip() == "error: /nonexistent/list.parquet: no such file"


def test_a_list_changed_since_the_crawl_began_is_not_resumed(tmp_path: Path, parquet_list: Path,
                                                              capsys: pytest.CaptureFixture[str],
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("KAFKA_HOSTS", "REDIS_URL", "S3_ENDPOINT_URL", "S3_BUCKET"):
        monkeypatch.delenv(name, raising=False)
    out = tmp_path / "out"
    argv = ["--url_list", str(parquet_list), "--url_col", "URL", "--output_folder", str(out)]
    checks.start_run(parse(argv), [parquet_list], lambda: __import__("uuid").uuid4())
    pq.write_table(pa.table({"URL": ["http://a.test/1.jpg", "http://a.test/2.jpg"]}), parquet_list)
    assert "files" in _refused(argv, capsys)
