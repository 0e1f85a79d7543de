"""The built-in rules against the labelled real kernel lines in reference/kmsg/."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from gpuguard.kernel.kmsg import parse_record
from gpuguard.kernel.rules import Rules
from gpuguard.kernel.saved_log import parse_saved_log

# Labels whose `bdf` names an address that is not in the labelled text (the line's own
# address disagrees). The classifier reports the address the kernel printed; these
# entries record the disagreement so a fix upstream shows up here.
#   text substring -> (labelled bdf, bdf in the text)
KNOWN_LABEL_BDF_ERRORS = {
    "NVRM: Xid (PCI:0000:3b:00 GPU-I:01): 43": ("0000:bb:00.0", "0000:3b:00.0"),
    "NVRM: Xid (PCI:0000:d3:00): 79, pid=0": ("0000:09:00.0", "0000:d3:00.0"),
}


@pytest.fixture(scope="module")
def rules() -> Rules:
    return Rules.load()


def _expected_bdf(item: dict) -> str | None:
    for needle, (labelled, actual) in KNOWN_LABEL_BDF_ERRORS.items():
        if needle in item["text"]:
            assert item["bdf"] == labelled, f"label fixed upstream? drop {needle!r} from KNOWN_LABEL_BDF_ERRORS"
            return actual
    return item.get("bdf")


def _ok(kind: str, item: dict) -> bool:
    allowed = {item["label"], *(item.get("alt_labels") or [])}
    if item.get("role") == "context":
        allowed.add("none")
    return kind in allowed


def test_every_labelled_line_is_classified_as_labelled(rules, labelled):
    wrong = []
    for item in labelled:
        text = item["text"]
        m = rules.classify(text)
        kind = m.kind if m else "none"
        if not _ok(kind, item):
            wrong.append(f"{item['label']:>20} ({item.get('role')}) got {kind}: {text}")
            continue
        if m is None:
            continue
        expected = _expected_bdf(item)
        if expected is not None and m.bdf != expected:
            wrong.append(f"bdf {m.bdf} != {expected}: {text}")
        if item.get("bdf_all") and list(m.bdf_all) != item["bdf_all"]:
            wrong.append(f"bdf_all {list(m.bdf_all)} != {item['bdf_all']}: {text}")
        if item["label"] == "nvidia_xid" and item.get("role") == "primary" and m.xid != item["xid"]:
            wrong.append(f"xid {m.xid} != {item['xid']}: {text}")
    assert not wrong, "\n".join(wrong)


def test_primary_lines_strictly_and_benign_lines_unmatched(rules, labelled):
    primaries = [i for i in labelled if i.get("role", "primary") == "primary"]
    assert len(primaries) > 50
    for item in primaries:
        m = rules.classify(item["text"])
        kind = m.kind if m else "none"
        assert kind == item["label"] or kind in (item.get("alt_labels") or []), item["text"]
    benign = [i for i in labelled if i["label"] == "none"]
    assert benign, "the sample has benign lines"
    assert [i["text"] for i in benign if rules.classify(i["text"])] == []


# How each saved-log format prints one message (`{t}` = the message text).
SAVED_FORMS = {
    "dmesg": "[  312.522692] {t}",
    "dmesg-caller": "[  312.522692] [ T291] {t}",
    "dmesg-caller-tight": "[  312.522692][    C3] {t}",
    "dmesg-T": "[Sun Nov 29 02:58:01 2026] {t}",
    "dmesg-x": "kern  :err   : [  312.522692] {t}",
    "dmesg-r": "<3>[  312.522692] {t}",
    "dmesg-iso": "2026-11-29T02:58:01,522692+00:00 {t}",
    "journal-short": "Nov 29 02:58:01 gpuhost kernel: {t}",
    "journal-precise": "Nov 29 02:58:01.522692 gpuhost kernel: {t}",
    "journal-iso": "2026-11-29T02:58:01+0000 gpuhost kernel: {t}",
    "journal-iso-precise": "2026-11-29T02:58:01.522692+00:00 gpuhost kernel: {t}",
    "journal-monotonic": "[  312.522692] gpuhost kernel: {t}",
    "syslog-with-stamp": "Nov 29 02:58:01 gpuhost kernel: [  312.522692] {t}",
    "kmsg": "3,41207,312522692,-;{t}",
}


@pytest.mark.parametrize("form", sorted(SAVED_FORMS))
def test_every_labelled_line_survives_every_saved_log_format(rules, labelled, form):
    single_line = [i for i in labelled if "\n" not in i["text"]]
    lines = [SAVED_FORMS[form].format(t=i["text"]) for i in single_line]
    entries = list(parse_saved_log(lines))
    assert [e.text for e in entries] == [i["text"] for i in single_line]
    for entry, item in zip(entries, single_line):
        m, direct = rules.classify(entry.text), rules.classify(item["text"])
        assert (m and (m.kind, m.bdf, m.xid)) == (direct and (direct.kind, direct.bdf, direct.xid))


def test_raw_records_parse_and_classify_per_meta(rules, reference: Path):
    meta = {}
    with open(reference / "kmsg" / "raw_records.meta.jsonl", encoding="utf-8") as f:
        for line in f:
            if line.strip():
                item = json.loads(line)
                meta[item["seq"]] = item
    data = (reference / "kmsg" / "raw_records.txt").read_bytes()
    # Split the file into records: a header line plus its ` KEY=VALUE` lines.
    chunks: list[list[bytes]] = []
    for line in data.split(b"\n"):
        if not line:
            continue
        if line.startswith(b" "):
            chunks[-1].append(line)
        else:
            chunks.append([line])
    records = [parse_record(b"\n".join(c) + b"\n") for c in chunks]
    assert sorted(r.seq for r in records) == sorted(meta)
    for rec in records:
        item = meta[rec.seq]
        assert rec.raw_text == item["text"]
        assert rec.facility == 0
        m = rules.classify(rec.text)
        assert m is not None and m.kind == item["label"], rec.text
        if item["xid"] is not None:
            assert m.xid == item["xid"]
        expected = _expected_bdf({"text": rec.raw_text, "bdf": item["bdf"]})
        got = rec.device_bdf or m.bdf
        assert got == expected, rec.raw_text
        if "DEVICE" in rec.fields:
            assert rec.fields["SUBSYSTEM"] == "pci"
            assert rec.device_bdf == expected
    # The caller= header field and the one multi-line NVRM record.
    caller = next(r for r in records if r.seq == 41256)
    assert caller.caller == "T291"
    nvrm = next(r for r in records if r.seq == 41270)
    assert nvrm.text.count("\n") == 2 and "\\x0a" in nvrm.raw_text
