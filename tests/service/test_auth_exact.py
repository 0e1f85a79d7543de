"""Token file, token matching, bearer parsing, loopback and the exposure warnings, exactly:
the words of every refusal (they tell the operator what to run), each boundary (16
characters, mode bits, the owner), which listen addresses count as loopback.
bench/mutation.sh found these answers unobserved."""
from __future__ import annotations

import os

import pytest

from gpuguard.control.auth import (
    AccessPolicy,
    Caller,
    TokenFileError,
    TokenStore,
    bearer_token,
    exposure_warnings,
    is_loopback,
)

A = "a" * 16
B = "b" * 32


def token_file(tmp_path, text: str, mode: int = 0o600):
    f = tmp_path / "tokens.yaml"
    f.write_text(text)
    os.chmod(f, mode)
    return f


def refused(path) -> str:
    with pytest.raises(TokenFileError) as e:
        TokenStore.load(str(path))
    return str(e.value)


def test_a_good_file_loads_names_and_matches(tmp_path):
    f = token_file(tmp_path, f"alice: {A}\nbob.ops-1: {B}\n", 0o400)
    store = TokenStore.load(str(f))
    assert (store.names, len(store), store.source) == (["alice", "bob.ops-1"], 2, str(f))
    assert (store.match(A), store.match(B), store.match(A + "x"), store.match("")) == ("alice", "bob.ops-1", None, None)
    assert store.match("\udcff" * 16) is None  # undecodable bytes compare, never crash


def test_no_file_configured_matches_nothing():
    store = TokenStore.load(None)
    assert (store.names, len(store), store.source, store.match(A)) == ([], 0, None, None)


def test_an_empty_file_has_no_tokens(tmp_path):
    assert len(TokenStore.load(str(token_file(tmp_path, "")))) == 0


def test_a_caller_is_audited_by_name():
    assert Caller("alice").who == "api:alice"


@pytest.mark.parametrize("mode", [0o640, 0o604, 0o660, 0o610, 0o601])
def test_a_file_others_can_read_or_write_is_refused(tmp_path, mode):
    f = token_file(tmp_path, f"alice: {A}\n", mode)
    assert refused(f) == (f"api.token_file {f}: mode {mode:04o} lets other users read or write the tokens; "
                          f"run: chmod 600 {f}")


def test_a_missing_file_a_folder_and_a_symlink(tmp_path):
    assert refused(tmp_path / "none.yaml") == f"api.token_file {tmp_path / 'none.yaml'}: cannot open: No such file or directory"
    d = tmp_path / "dir"
    d.mkdir(mode=0o700)
    assert refused(d) == f"api.token_file {d}: not a regular file"
    real = token_file(tmp_path, f"alice: {A}\n")
    link = tmp_path / "link.yaml"
    link.symlink_to(real)
    assert refused(link) == f"api.token_file {link}: cannot open: Too many levels of symbolic links"


def test_a_file_owned_by_another_user_is_refused(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("needs root to give the file to another user")
    f = token_file(tmp_path, f"alice: {A}\n")
    os.chown(f, 4242, 4242)
    assert refused(f) == (f"api.token_file {f}: owned by uid 4242, not by the daemon's user (uid 0); "
                          f"run: chown root: {f}")


def test_not_yaml_names_the_line(tmp_path):
    f = token_file(tmp_path, f"alice: {A}\nbob: [unclosed\n")
    assert refused(f) == f"api.token_file {f} line 3: not valid YAML"


def test_yaml_that_is_not_a_mapping(tmp_path):
    f = token_file(tmp_path, f"- {A}\n")
    assert refused(f) == f"api.token_file {f}: must be a mapping of name: token lines"


@pytest.mark.parametrize("name", ["has space", "", "x" * 65, "ünï"])
def test_token_names(tmp_path, name):
    f = token_file(tmp_path, f"'{name}': {A}\n")
    assert refused(f) == f"api.token_file {f}: token name {name!r} must match ^[A-Za-z0-9_.-]{{1,64}}$"


def test_a_64_character_name_is_fine(tmp_path):
    assert TokenStore.load(str(token_file(tmp_path, f"{'x' * 64}: {A}\n"))).names == ["x" * 64]


@pytest.mark.parametrize("value", ["a" * 15, "'aaaaaaaa aaaaaaaa'", "12345678901234567890", "'aaaaaaaaaaaaaaaa\t'"])
def test_short_spaced_or_non_string_tokens_are_refused_without_echoing_them(tmp_path, value):
    f = token_file(tmp_path, f"alice: {value}\n")
    msg = refused(f)
    assert msg == (f"api.token_file {f}: token 'alice' must be a string of at least 16 characters without "
                   "spaces (e.g. from: openssl rand -hex 32)")


def test_two_names_sharing_one_token(tmp_path):
    f = token_file(tmp_path, f"alice: {A}\nbob: {A}\n")
    assert refused(f) == f"api.token_file {f}: two names share one token; the audit log could not tell them apart"


@pytest.mark.parametrize("address,loop", [
    ("127.0.0.1", True), ("127.8.9.10", True), ("::1", True), ("[::1]", True), ("localhost", True),
    ("ip6-localhost", True), ("0.0.0.0", False), ("::", False), ("192.168.1.5", False), ("gpu-host", False),
])
def test_loopback(address, loop):
    assert is_loopback(address) is loop


def test_reads_need_a_token_only_beyond_loopback_without_open_reads():
    assert AccessPolicy().reads_need_token is False
    assert AccessPolicy("0.0.0.0").reads_need_token is True
    assert AccessPolicy("0.0.0.0", open_reads=True).reads_need_token is False
    assert AccessPolicy("::1").reads_need_token is False


@pytest.mark.parametrize("header,token", [
    (None, None), ("", None), ("Bearer abc", "abc"), ("bearer  abc  ", "abc"), ("BEARER abc", "abc"),
    ("Basic abc", None), ("Bearer", None), ("Bearer   ", None), ("Token abc", None),
])
def test_bearer_token(header, token):
    assert bearer_token(header) == token


def test_exposure_warnings():
    assert exposure_warnings("127.0.0.1", True, None) == []
    assert exposure_warnings("0.0.0.0", False, "/etc/gpuguard/tokens.yaml") == []
    assert exposure_warnings("0.0.0.0", True, None) == [
        "api: listening on 0.0.0.0 with api.open_reads: true: /metrics, /v1/status, /v1/config and /v1/events are "
        "readable by anyone who can reach this host, without a token",
        "api: listening on 0.0.0.0 without api.token_file: reads need a token nobody has and every change is "
        "refused; set api.token_file or listen on 127.0.0.1",
    ]


def test_a_file_yaml_cannot_even_read_names_no_line(tmp_path):
    f = token_file(tmp_path, f"alice: {A}\x07\n")
    assert refused(f) == f"api.token_file {f}: not valid YAML"


def test_the_token_file_is_utf8_whatever_the_locale(tmp_path):
    import locale
    import sys

    if sys.flags.utf8_mode:
        pytest.skip("Python's UTF-8 mode ignores the locale")
    f = token_file(tmp_path, f"# clé de l'équipe\nalice: {A}\n")
    old = locale.setlocale(locale.LC_CTYPE)
    locale.setlocale(locale.LC_CTYPE, "C")
    try:
        if locale.getpreferredencoding(False).lower() in ("utf-8", "utf8"):
            pytest.skip("the C locale is UTF-8 here")
        assert TokenStore.load(str(f)).names == ["alice"]
    finally:
        locale.setlocale(locale.LC_CTYPE, old)
