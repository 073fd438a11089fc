"""Callback signatures during a rotation, and whose callbacks the deprecated deployment-wide secret may sign."""

from __future__ import annotations

import pytest

from stoker.core.callbacks import deployment_fallback, sign, signature_header, verify
from stoker.core.tenancy import DEFAULT_TENANT

BODY = b'{"id": "j1", "status": "succeeded"}'
NOW = 1_700_000_000


def test_one_live_secret_signs_as_before() -> None:
    header = signature_header(["whsec_new"], NOW, BODY)
    assert header == sign("whsec_new", NOW, BODY)
    assert header.startswith("v1=")
    assert "," not in header


def test_during_a_rotation_either_secret_verifies_the_delivery() -> None:
    header = signature_header(["whsec_new", "whsec_old"], NOW, BODY)
    assert header == f"{sign('whsec_new', NOW, BODY)},{sign('whsec_old', NOW, BODY)}"  # the new one first
    assert verify("whsec_new", str(NOW), BODY, header, NOW)
    assert verify("whsec_old", str(NOW), BODY, header, NOW)
    assert not verify("whsec_other", str(NOW), BODY, header, NOW)  # a third party's secret
    assert not verify("whsec_old", str(NOW), BODY + b" ", header, NOW)  # an altered body
    assert not verify("whsec_new", str(NOW), BODY, header, NOW + 301)  # replayed later


def test_a_delivery_is_signed_with_at_least_one_secret() -> None:
    with pytest.raises(ValueError, match="at least one"):
        signature_header([], NOW, BODY)


def test_the_deployment_secret_stands_in_only_for_the_default_tenant() -> None:
    assert deployment_fallback(DEFAULT_TENANT, "whsec_deployment") == "whsec_deployment"
    assert deployment_fallback("acme", "whsec_deployment") is None  # never another tenant's: they could forge
    assert deployment_fallback(DEFAULT_TENANT, None) is None
