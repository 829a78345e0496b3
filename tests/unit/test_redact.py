"""Passwords out of sight (redact.py): finding a URL's password in every form it takes, and redacting it from
any text, however the URL is written (unencoded ``#``, ``?``, ``@``, ``/``, a space: users and libpq do not
always percent-encode)."""

from __future__ import annotations

import pytest

from onward.redact import redact_one_url, redact_url, scrub, url_secrets

HOST = "@127.0.0.1:5432/jobs"

# (the password as written in the URL, the password it stands for)
HOSTILE_PASSWORDS = [
    ("p#w?x", "p#w?x"),
    ("p%23w%3Fx", "p#w?x"),
    ("a?b", "a?b"),
    ("a#", "a#"),
    ("my pw", "my pw"),
    ("p@ss", "p@ss"),
    ("s/la:sh", "s/la:sh"),
    ("plain-S3cret", "plain-S3cret"),
]


@pytest.mark.parametrize(("written", "meant"), HOSTILE_PASSWORDS)
def test_a_password_with_hash_question_mark_or_space_is_found_and_redacted(written: str, meant: str) -> None:
    url = f"postgresql://postgres:{written}{HOST}"
    secrets = url_secrets(url)
    assert written in secrets and meant in secrets
    shown = redact_url(url)
    assert shown == f"postgresql://postgres:***{HOST}"
    for text in (f"could not connect to {url}: refused", f"password {meant!r} rejected", f"--db={url}"):
        cleaned = scrub(text, secrets)
        assert written not in cleaned and meant not in cleaned, cleaned


def test_a_url_inside_a_longer_argument_is_found() -> None:
    assert "p#w?x" in url_secrets("--db=postgresql://u:p#w?x@db.example/jobs")
    assert redact_url("ONWARD_DB=postgres://u:p#w?x@db.example/jobs x") == "ONWARD_DB=postgres://u:***@db.example/jobs x"


def test_a_password_parameter_with_hash_or_encoding_is_found_and_redacted() -> None:
    url = "postgresql://u@h/jobs?sslmode=disable&password=a%23b#c"
    secrets = url_secrets(url)
    assert "a%23b#c" in secrets and "a#b#c" in secrets
    assert redact_url(url) == "postgresql://u@h/jobs?sslmode=disable&password=***"


def test_text_without_a_password_is_left_alone() -> None:
    text = "GET https://api.example.com:443/v1 failed for user@example.org (postgresql://u@h/db)"
    assert redact_url(text) == text
    assert url_secrets(text) == []


def test_two_urls_on_one_line_keep_their_hosts() -> None:
    text = "copy postgresql://a:pw1@h1/db to postgresql://b:p w2@h2/db"
    assert redact_url(text) == "copy postgresql://a:***@h1/db to postgresql://b:***@h2/db"


@pytest.mark.parametrize("password", ["my pw/Secr3t", "a/b c@Secr3t", "Secr3t pw/x", "mix#@% '\"/?&=:Secr3t"])
def test_one_url_hides_a_password_with_both_a_space_and_a_slash(password: str) -> None:
    """In free text a password cannot be told from what follows when it holds both a space and a "/"; a
    store location is one URL, so its password runs to the last "@". Such a password was shown whole."""
    url = f"postgresql://postgres:{password}{HOST}"
    assert redact_one_url(url) == f"postgresql://postgres:***{HOST}"
    assert redact_one_url(f"--db={url}") == f"--db=postgresql://postgres:***{HOST}"
    secrets = url_secrets(url)
    assert password in secrets
    # What libpq quotes from such a URL: the part before the first "/", or the path after it.
    for quoted in password.split("/"):
        assert "Secr3t" not in scrub(f'unexpected spaces found in "{quoted}{HOST}"', secrets)


@pytest.mark.parametrize("password", ["Secr et99Word", "Sec&ret99Word", "Sec ret&99Word x"])
@pytest.mark.parametrize("before", ["", "sslmode=disable&"])
def test_one_url_hides_a_password_parameter_with_a_space_or_an_ampersand(password: str, before: str) -> None:
    """A ``password=`` of a store URL's query holding a space or an "&": the rule for free text stopped at
    either, and the error line showed the rest ("password=*** et99Word: unexpected spaces found in
    "*** et99Word""), as did libpq's own words for the part after an "&" ("missing key/value separator "=" in
    URI query parameter: "ret99Word""). A store location is one URL: the password runs to the next "&NAME="."""
    url = f"postgresql://u@127.0.0.1/jobs?{before}password={password}"
    assert redact_one_url(url) == f"postgresql://u@127.0.0.1/jobs?{before}password=***"
    assert redact_one_url(f"{url}&application_name=x").endswith("password=***&application_name=x")
    secrets = url_secrets(url)
    for quoted in (password, password.split("&")[-1], password.split(" ")[-1]):
        for message in (f'unexpected spaces found in "{quoted}"', f'in URI query parameter: "{quoted}"'):
            cleaned = scrub(message, secrets)
            assert "99Word" not in cleaned and "ret" not in cleaned.replace("parameter", ""), cleaned


def test_a_short_password_is_hidden_where_it_stands_alone_not_inside_words() -> None:
    """A password "ex": every "ex" in a task's error was masked ("n*** ***ample: ind*** ***hausted"), which
    garbled the text and showed where the password's letters were. A secret shorter than 8 characters is now
    hidden where it stands alone; a longer one wherever it occurs, as before."""
    secrets = url_secrets("postgresql://u:ex@127.0.0.1/db")
    assert scrub("next example: index exhausted", secrets) == "next example: index exhausted"
    assert scrub("password 'ex' rejected, password=ex and u:ex@h", secrets) == \
        "password '***' rejected, password=*** and u:***@h"
    long = url_secrets("postgresql://u:hunter22@127.0.0.1/db")
    assert scrub("password%3Dhunter22 and xhunter22y", long) == "password%3D*** and x***y"
    # A URL libpq refuses: a piece of one letter ("p", before the first "@") no longer eats every "p".
    secrets = url_secrets("postgresql://u:p@ss w/rd@127.0.0.1:1/db")
    assert scrub('unexpected spaces found in "ss w", use percent-encoded spaces', secrets) == \
        'unexpected spaces found in "***", use percent-encoded spaces'


def test_a_password_parameter_leaves_the_colon_of_the_message_after_it() -> None:
    """``?password=…`` was hidden up to the next space, the colon of "store URL: connection failed" with it."""
    shown = redact_url("store postgresql://u@h/db?password=wrongSECRET: connection failed: refused")
    assert shown == "store postgresql://u@h/db?password=***: connection failed: refused"
    assert redact_url("postgresql://u@h/db?password=a:b") == "postgresql://u@h/db?password=***"
