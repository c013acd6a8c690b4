"""The contracts module: validation of inbound messages and one home for every name."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from common import contracts
from common.contracts import InvalidMessage, parse_crawl_request

ROOT = Path(__file__).resolve().parent.parent


def msg(**fields) -> bytes:
    base = {"url": "https://example.org/a.jpg", "uuid": "u-1", "source": "Example"}
    base.update(fields)
    return json.dumps({k: v for k, v in base.items() if v is not ...}).encode()


def test_valid_message_lower_cases_source() -> None:
    req = parse_crawl_request(msg())
    assert (req.url, req.uuid, req.source, req.attempts) == ("https://example.org/a.jpg", "u-1", "example", 0)
    assert parse_crawl_request(msg(attempts=2)).attempts == 2


@pytest.mark.parametrize("raw", [
    None, b"", b"\xff\xfe", b"not json", b"[1, 2]", b"null", b'"a string"',
    msg(url=...), msg(url=""), msg(url=5), msg(url="ftp://example.org/a.jpg"),
    msg(url="javascript:alert(1)"), msg(url="http://"), msg(url="https://example.org/" + "a" * 2048),
    msg(url="http://exa mple.org/a.jpg"), msg(url="http://example.org:99999/a.jpg"),
    msg(uuid=...), msg(uuid=""), msg(uuid="  "), msg(uuid=7),
    b"[" * 100_000, msg(url="https://example.org/\ud800.jpg"), msg(uuid="a\nb"), msg(uuid="u" * 201),
    msg(uuid="\udfff"), msg(source=...), msg(source=""), msg(source="bad source"), msg(source="../etc"[:0] + "a/b"),
    msg(source="x" * 300), msg(source=None), msg(attempts=-1), msg(attempts="1"), msg(attempts=True),
])
def test_invalid_messages_are_rejected_with_a_reason(raw) -> None:
    with pytest.raises(InvalidMessage) as info:
        parse_crawl_request(raw)
    assert str(info.value)


def test_rejected_message_keeps_at_most_4_kib_of_raw() -> None:
    out = json.loads(contracts.rejected_message("inbound_images", b"\xff" + b"a" * 10_000, "not JSON"))
    assert set(out) == {"topic", "raw", "error", "time"}
    assert len(out["raw"].encode("utf-8")) <= 4096 + 3  # the replacement character is 3 bytes


SPEC_KEY_LITERALS = [
    "inbound_sources", "num_split", "currtokens", "override_rate", "halted", "temp_halted",
    "status60s", "status1hr", "status12hr", "statuslast50req", "num_resized", "resize_errors",
    "inbound_images", "image_metadata_updates", "link_rot", "crawl_errors", "rejected_messages",
]


@pytest.mark.parametrize("name", SPEC_KEY_LITERALS)
def test_each_spec_name_is_written_in_exactly_one_module(name: str) -> None:
    """No key or topic name is spelled twice outside the tests."""
    pattern = re.compile(r"""["'{]""" + re.escape(name) + r"""[:"'}]""")
    homes = []
    for path in ROOT.rglob("*.py"):
        rel = path.relative_to(ROOT)
        if rel.parts[0] in ("test", ".venv", "bench") or "site-packages" in rel.parts:
            continue
        if pattern.search(path.read_text(encoding="utf-8")):
            homes.append(str(rel))
    assert homes == ["common/contracts.py"], homes


def test_no_log_event_name_is_written_outside_common() -> None:
    """Every event name is a constant of common.contracts, so a typo cannot rename one."""
    literal = re.compile(r"""log_event\(\s*["']""")
    offenders = [str(path.relative_to(ROOT)) for path in ROOT.rglob("*.py")
                 if path.relative_to(ROOT).parts[0] not in ("test", ".venv")
                 and "site-packages" not in path.parts and literal.search(path.read_text(encoding="utf-8"))]
    assert offenders == [], offenders


def test_each_event_line_carries_its_level(capsys) -> None:
    from common.jsonlog import log_event
    log_event(contracts.EVENT_CRAWL_HALTED, source="s")
    log_event(contracts.EVENT_MONITORING_UPDATE)
    log_event(contracts.EVENT_TASK_CRASHED)
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [(line["event"], line.get("level")) for line in lines] == [
        ("crawl_halted", None), ("monitoring_update", None), ("task_crashed", "error")]  # SPEC's shapes kept


def test_no_status_name_is_written_outside_common() -> None:
    """Each status is a member of common.statuses.Status: a typo cannot change behaviour."""
    from common.statuses import Status
    names = re.compile(r"""["'](""" + "|".join(re.escape(s.value) for s in Status) + r""")["']""")
    offenders = [f"{path.relative_to(ROOT)}: {match.group(0)}" for path in ROOT.rglob("*.py")
                 if path.relative_to(ROOT).parts[0] in ("common", "crawl_monitor", "worker")
                 and path.name != "statuses.py"
                 for match in [names.search(path.read_text(encoding="utf-8"))] if match]
    assert offenders == [], offenders


def test_status_policy_as_data_and_the_wire_text_unchanged() -> None:
    from common.statuses import Status, in_windows, is_expected, is_retryable
    assert Status.TIMEOUT == "Timeout" and f"{Status.ROBOTS_DISALLOWED}" == "RobotsDisallowed"
    assert [s for s in ("Timeout", "ServerDisconnected", "ConnectionError", "BadResponse", "500", "TooLarge")
            if is_retryable(s)] == ["Timeout", "ServerDisconnected", "ConnectionError"]
    assert all(is_expected(s) for s in ("200", "301", "308", "404", "410", "UnidentifiedImageError",
                                        "RobotsDisallowed"))
    assert not any(is_expected(s) for s in ("500", "429", "403", "Timeout", "ForbiddenAddress", "SomeError"))
    assert not in_windows("ForbiddenAddress") and in_windows("Timeout") and in_windows("404")


def test_a_uuid_keeps_its_thumbnail_key_and_other_identifiers_are_escaped() -> None:
    """SPEC.md §5, "Thumbnails": downstream systems rely on ``{uuid}.jpg``."""
    assert contracts.thumbnail_key("0b9f6a3e-4b0e-4c8e-9d5a-1f2e3d4c5b6a") == "0b9f6a3e-4b0e-4c8e-9d5a-1f2e3d4c5b6a.jpg"
    assert contracts.thumbnail_key("0B9F6A3E-4B0E-4C8E-9D5A-1F2E3D4C5B6A") == "0B9F6A3E-4B0E-4C8E-9D5A-1F2E3D4C5B6A.jpg"
    assert contracts.thumbnail_key("photo_12.v2~x") == "photo_12.v2~x.jpg"
    assert contracts.thumbnail_key("../../other/owned") == "..!2F..!2Fother!2Fowned.jpg"
    assert contracts.thumbnail_key("..\\x\\y") == "..!5Cx!5Cy.jpg"
    assert contracts.thumbnail_key("é") == "!C3!A9.jpg"
    # "!" is escaped too, so neither of these can take the other's key.
    assert contracts.thumbnail_key("a!2Fb") == "a!212Fb.jpg" != contracts.thumbnail_key("a/b") == "a!2Fb.jpg"
    assert contracts.thumbnail_key("a%2Fb") == "a!252Fb.jpg"


def test_thumbnail_keys_are_one_to_one() -> None:
    """Every character class at every position of short strings: no two share a key, and each
    key gives its identifier back."""
    alphabet = ["a", "Z", "0", ".", "-", "_", "~", "!", "%", "/", "\\", "?", "#", " ", "2", "F", "é", "\uff0e"]
    identifiers = [a + b + c for a in alphabet for b in alphabet for c in alphabet]
    keys = {contracts.thumbnail_key(i) for i in identifiers}
    assert len(keys) == len(identifiers)
    assert all(contracts.identifier_of_key(contracts.thumbnail_key(i)) == i for i in identifiers)
    assert all(re.fullmatch(r"[A-Za-z0-9._~!-]+\.jpg", key) for key in keys)


@pytest.mark.parametrize("uuid, accepted", [
    ("a" * 200, True), ("a/" * 62 + "a", True), ("a/" * 63, False), ("é" * 41, True), ("é" * 42, False),
    ("字" * 27, True), ("字" * 28, False),
])
def test_an_identifier_whose_key_is_past_255_bytes_is_refused(uuid: str, accepted: bool) -> None:
    if accepted:
        assert len(contracts.thumbnail_key(parse_crawl_request(msg(uuid=uuid)).uuid)) <= contracts.MAX_KEY_BYTES
    else:
        with pytest.raises(InvalidMessage, match="thumbnail key would be"):
            parse_crawl_request(msg(uuid=uuid))
