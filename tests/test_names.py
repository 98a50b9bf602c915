"""Names are checked whole: a model name, an alias or a version reference with a trailing newline
(which a `$` anchor lets through) is refused with a message naming it, on every route."""

from __future__ import annotations

import pytest

from cloud.errors import InvalidRequest
from registry import version_ref
from registry.registry import ALIAS_PATTERN, NAME_PATTERN
from tests.conftest import auth
from tests.onnx_models import mlp


@pytest.mark.parametrize("name", ["nl\n", "prod\n", "a\nb", "ñame", "\nx"])
def test_an_upload_name_that_is_not_wholly_ascii_letters_digits_or_dots_is_refused(client, keys, name) -> None:
    response = client.post(
        "/v1/models",
        headers=auth(keys["alice"]),
        files={"file": ("m.onnx", mlp().SerializeToString())},
        data={"name": name},
    )
    assert response.status_code == 400, response.text
    assert "ASCII letters" in response.json()["error"]["message"]
    assert client.get("/v1/models", headers=auth(keys["alice"])).json()["models"] == []


def test_aliases_and_version_references_are_matched_whole() -> None:
    for text in ("prod\n", "prod\r\n", "pro d"):
        assert ALIAS_PATTERN.fullmatch(text) is None
        with pytest.raises(InvalidRequest, match="neither a version number nor an alias"):
            version_ref(text)
    assert NAME_PATTERN.fullmatch("nl\n") is None and NAME_PATTERN.fullmatch("nl") is not None
    assert version_ref("prod") == "prod" and version_ref("12") == 12


def test_an_alias_with_a_trailing_newline_is_refused_over_http(client, keys) -> None:
    response = client.put(
        "/v1/models/m/aliases/prod%0A", json={"version": 1}, headers=auth(keys["alice"])
    )
    assert response.status_code == 400, response.text
    assert "alias 'prod\\n' is invalid" in response.json()["error"]["message"]


def test_a_tenant_name_is_checked_whole(settings) -> None:
    from api.services import open_database
    from cloud.auth import create_key

    db = open_database(settings)
    try:
        with pytest.raises(InvalidRequest, match=r"tenant name 'acme\\n' is invalid"):
            create_key(db, "acme\n")
        assert create_key(db, "acme").startswith("lc_")
    finally:
        db.dispose()
