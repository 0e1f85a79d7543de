"""The token file: only a file no other user can read is accepted; names, not tokens,
identify callers; comparison covers every token."""
import os

import pytest

from gpuguard.control.auth import AccessPolicy, TokenFileError, TokenStore, bearer_token, is_loopback

pytestmark = [pytest.mark.root]  # registered in pyproject.toml


def test_tokens_load_and_match_by_name(tmp_path, make_token_file, tokens):
    store = TokenStore.load(str(make_token_file(tmp_path / "tokens")))
    assert store.names == ["alice", "ci"]
    assert store.match(tokens["ci"]) == "ci"
    assert store.match(tokens["alice"]) == "alice"
    assert store.match(tokens["alice"][:-1]) is None
    assert store.match(tokens["alice"] + "x") is None
    assert store.match("") is None


@pytest.mark.parametrize("mode", [0o640, 0o604, 0o644, 0o660, 0o602])
def test_group_or_world_accessible_file_is_refused_with_the_fix(tmp_path, make_token_file, mode):
    p = make_token_file(tmp_path / "tokens", mode=mode)
    with pytest.raises(TokenFileError) as e:
        TokenStore.load(str(p))
    assert str(p) in str(e.value) and f"chmod 600 {p}" in str(e.value)


def test_owner_only_modes_are_accepted(tmp_path, make_token_file):
    for mode in (0o600, 0o400):
        p = make_token_file(tmp_path / f"t{mode:o}", mode=mode)
        assert len(TokenStore.load(str(p))) == 2


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root: chown the file to another uid")
def test_file_owned_by_another_user_is_refused(tmp_path, make_token_file):
    p = make_token_file(tmp_path / "tokens")
    os.chown(p, 65534, 65534)
    with pytest.raises(TokenFileError, match="owned by uid 65534"):
        TokenStore.load(str(p))


def test_symlinked_token_file_is_refused(tmp_path, make_token_file):
    real = make_token_file(tmp_path / "real")
    (tmp_path / "link").symlink_to(real)
    with pytest.raises(TokenFileError, match="cannot open"):
        TokenStore.load(str(tmp_path / "link"))


@pytest.mark.parametrize(
    "text, message",
    [
        ("alice: short\n", "at least 16"),
        ("alice: [1, 2]\n", "at least 16"),
        ("- just a list\n", "mapping"),
        ("alice: 'aaaaaaaaaaaaaaaaaaaa'\nbob: 'aaaaaaaaaaaaaaaaaaaa'\n", "share one token"),
        ("'bad name!': 0123456789abcdef0123\n", "token name"),
        ("alice: [unclosed\nbob: x\n", "line [0-9]+: not valid YAML"),
    ],
)
def test_bad_token_files_name_the_problem_never_the_token(tmp_path, text, message):
    p = tmp_path / "tokens"
    p.write_text(text)
    os.chmod(p, 0o600)
    with pytest.raises(TokenFileError, match=message) as e:
        TokenStore.load(str(p))
    assert "aaaaaaaaaaaaaaaaaaaa" not in str(e.value)


def test_missing_file_names_it(tmp_path):
    with pytest.raises(TokenFileError, match="nope.*cannot open"):
        TokenStore.load(str(tmp_path / "nope"))


def test_no_file_configured_means_no_token_matches():
    assert TokenStore.load(None).match("anything-at-all-here") is None


def test_reads_need_a_token_only_beyond_loopback_without_open_reads():
    assert not AccessPolicy("127.0.0.1").reads_need_token
    assert not AccessPolicy("::1").reads_need_token
    assert not AccessPolicy("localhost").reads_need_token
    assert AccessPolicy("0.0.0.0").reads_need_token
    assert AccessPolicy("192.168.1.10").reads_need_token
    assert AccessPolicy("gpu-host.lan").reads_need_token
    assert not AccessPolicy("0.0.0.0", open_reads=True).reads_need_token
    assert is_loopback("127.8.9.1") and not is_loopback("::")


def test_bearer_header_parsing():
    assert bearer_token("Bearer abc") == "abc"
    assert bearer_token("bearer   abc ") == "abc"
    assert bearer_token("Basic abc") is None
    assert bearer_token("Bearer ") is None
    assert bearer_token(None) is None
