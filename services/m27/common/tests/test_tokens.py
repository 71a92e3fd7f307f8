"""API tokens and the access table, attacked: forged, altered, foreign, expired tokens;
a node key claiming more than it may; a user reaching past their runs and urgency."""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import os
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from m27.common import api_access, tokens
from m27.common.api_auth import (
    ensure_cli_token,
    ensure_keys,
    load_keys,
    server_credentials,
)
from m27.common.config import ApiSection, Config, SchedulerSection, load_config
from m27.common.errors import ConfigError
from m27.common.secret_files import read_secret
from m27.common.tokens import Identity, TokenError

NOW = 1_800_000_000.0
CONTROL = b"c" * 32
NODE = tokens.node_key(CONTROL)


def verify(token: str, *, control: bytes | None = CONTROL, node: bytes | None = NODE,
           now: float = NOW) -> Identity:
    return tokens.verify(token, control_key=control, node_key_=node, now=now)


def who(user: str = "alice", role: tokens.ApiRole = "user", **scope: object) -> Identity:
    return Identity(user=user, role=role, token_id="t",  # noqa: S106 - an id
                    **scope)  # type: ignore[arg-type]


users = st.from_regex(tokens.USER_NAME, fullmatch=True)


@given(user=users, role=st.sampled_from(["user", "admin", "service"]),
       ttl=st.one_of(st.just(0.0), st.floats(min_value=1, max_value=1e9)))
def test_a_control_token_says_who_minted_it_for(user: str, role: tokens.ApiRole,
                                                ttl: float) -> None:
    token = tokens.mint(CONTROL, "c", user=user, role=role, now=NOW, ttl_s=ttl)
    got = verify(token)
    assert (got.user, got.role) == (user, role)


@given(position=st.integers(min_value=0), replacement=st.sampled_from(
    "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_."))
def test_no_altered_token_verifies(position: int, replacement: str) -> None:
    """Every single-character change of a token (claims, signature, key id) is refused."""
    token = tokens.mint(CONTROL, "c", user="alice", role="user", now=NOW)
    index = position % len(token)
    if token[index] == replacement:
        return
    altered = token[:index] + replacement + token[index + 1:]
    with pytest.raises(TokenError):
        verify(altered)


def _forge(claims: dict[str, object], key: bytes, kid: str) -> str:
    body = "m27t1.{}.{}".format(kid, base64.urlsafe_b64encode(
        json.dumps(claims).encode()).rstrip(b"=").decode())
    mac = hmac.new(key, body.encode(), hashlib.sha256).digest()
    return f"{body}.{base64.urlsafe_b64encode(mac).rstrip(b'=').decode()}"


def test_claims_rewritten_to_admin_without_the_key_are_refused() -> None:
    token = tokens.mint(CONTROL, "c", user="alice", role="user", now=NOW)
    _prefix, kid, _claims, mac = token.split(".")
    raised = base64.urlsafe_b64encode(json.dumps(
        {"sub": "alice", "role": "admin", "jti": "x", "iat": NOW}).encode()).rstrip(b"=")
    with pytest.raises(TokenError, match="signature"):
        verify(f"m27t1.{kid}.{raised.decode()}.{mac}")


def test_a_token_of_another_system_is_refused() -> None:
    other = tokens.mint(os.urandom(32), "c", user="alice", role="admin", now=NOW)
    with pytest.raises(TokenError, match="signature"):
        verify(other)


def test_the_node_key_cannot_make_an_admin_or_a_user() -> None:
    """A machine that holds only node.key forges no control-plane identity: minting
    refuses, and a hand-made token claiming admin is refused on verification."""
    with pytest.raises(ValueError, match="node key signs only"):
        tokens.mint(NODE, "n", user="mallory", role="admin", now=NOW)
    for role in ("admin", "user", "service"):
        forged = _forge({"sub": "mallory", "role": role, "jti": "x", "iat": NOW}, NODE, "n")
        with pytest.raises(TokenError, match="cannot claim"):
            verify(forged)
    # …and the node key cannot pass as the control key.
    forged = _forge({"sub": "mallory", "role": "admin", "jti": "x", "iat": NOW}, NODE, "c")
    with pytest.raises(TokenError, match="signature"):
        verify(forged)


def test_a_node_agent_holding_no_control_key_refuses_control_tokens() -> None:
    admin = tokens.mint(CONTROL, "c", user="root", role="admin", now=NOW)
    with pytest.raises(TokenError, match="does not accept"):
        verify(admin, control=None)
    node = tokens.mint(NODE, "n", user="orchestrator", role="node", now=NOW)
    assert verify(node, control=None).role == "node"


def test_expired_and_malformed_tokens_are_refused() -> None:
    token = tokens.mint(CONTROL, "c", user="alice", role="user", now=NOW, ttl_s=60)
    assert verify(token, now=NOW + 59).user == "alice"
    with pytest.raises(TokenError, match="expired"):
        verify(token, now=NOW + 60)
    for bad in ("", "Bearer", "m27t1.c.x", "x" * 10_000, "m27t1.c.!!!.???", "m27t1.z.a.b"):
        with pytest.raises(TokenError):
            verify(bad)


def test_a_step_token_carries_its_task_and_only_it_may() -> None:
    with pytest.raises(ValueError, match="names its task"):
        tokens.mint(NODE, "n", user="s", role="step", now=NOW)
    with pytest.raises(ValueError, match="names its task"):
        tokens.mint(CONTROL, "c", user="alice", role="user", now=NOW, task_id="r/a")
    step = verify(tokens.mint(NODE, "n", user="s", role="step", now=NOW, task_id="r/a",
                              attempt=3))
    assert (step.task_id, step.attempt) == ("r/a", 3)


# ---------------------------------------------------------------- the access table


def test_every_rpc_of_every_proto_service_is_in_the_table() -> None:
    """A new RPC without a rule would be refused to everyone: the table must name it."""
    from m27.v1 import checkpoint_pb2, cluster_pb2, pipeline_pb2, scheduler_pb2

    methods = {f"/{service.full_name}/{method.name}"
               for module in (checkpoint_pb2, cluster_pb2, pipeline_pb2, scheduler_pb2)
               for service in module.DESCRIPTOR.services_by_name.values()
               for method in service.methods}
    assert methods <= set(api_access.METHOD_ROLES)


def test_who_may_call_what() -> None:
    problem = api_access.call_problem
    assert problem("/m27.v1.SchedulerService/SetNodeMaintenance", who()) is not None
    assert problem("/m27.v1.SchedulerService/SetNodeMaintenance", who(role="admin")) is None
    assert problem("/m27.v1.CheckpointService/Delete", who(role="node")) is not None
    assert problem("/m27.v1.CheckpointService/Commit", who(role="user")) is not None
    assert problem("/m27.v1.PipelineService/CancelRun", who(role="service")) is not None
    assert problem("/m27.v1.PipelineService/GetRun", who(role="step")) is not None
    assert problem("/m27.v1.NodeService/TailLog", who(role="admin")) is not None
    assert problem("/some.Other/Method", who(role="admin")) is not None


def test_a_user_sees_and_changes_only_their_own_runs() -> None:
    assert api_access.run_problem(who("alice"), "alice", "r", acting=True) is None
    assert api_access.run_problem(who("alice"), "bob", "r", acting=False) is not None
    assert api_access.run_problem(who("alice"), "bob", "r", acting=True) is not None
    assert api_access.run_problem(who("report", "service"), "bob", "r", acting=False) is None
    assert api_access.run_problem(who("report", "service"), "bob", "r", acting=True)
    assert api_access.run_problem(who("root", "admin"), "bob", "r", acting=True) is None


def test_the_user_comes_from_the_token() -> None:
    assert api_access.submitter(who("alice"), "") == ("alice", None)
    user, problem = api_access.submitter(who("alice"), "pi")
    assert user == "alice"
    assert problem is not None
    assert "pi" in problem
    assert api_access.submitter(who("root", "admin"), "bob") == ("bob", None)


def test_urgency_is_capped_by_level() -> None:
    rules = api_access.levels(Config(scheduler=SchedulerSection(user_levels="carol:pi")))
    assert api_access.urgency_problem(who("alice"), ["high", "low"], rules) is None
    assert "urgent" in (api_access.urgency_problem(who("alice"), ["urgent"], rules) or "")
    assert api_access.urgency_problem(who("carol"), ["urgent"], rules) is None
    assert api_access.urgency_problem(who("root", "admin"), ["urgent"], rules) is None
    strict = api_access.levels(Config(api=ApiSection(max_urgency="student:normal")))
    assert api_access.urgency_problem(who("alice"), ["high"], strict) is not None
    with pytest.raises(ConfigError, match="unknown urgency"):
        api_access.levels(Config(api=ApiSection(max_urgency="student:asap")))


def test_a_step_writes_only_its_own_attempt() -> None:
    step = who("s", "step", task_id="r/a", attempt=2)
    assert api_access.checkpoint_problem(step, "r/a", 2) is None
    assert api_access.checkpoint_problem(step, "r/b", 2) is not None
    assert api_access.checkpoint_problem(step, "r/a", 1) is not None
    assert api_access.checkpoint_problem(who(role="node"), "r/b", 1) is None


# ---------------------------------------------------------------- files and transport


def test_keys_and_tokens_are_files_only_their_owner_reads(tmp_path: Path) -> None:
    token_path = ensure_cli_token(tmp_path, "alice")
    for path in (token_path, token_path.with_name("control.key"),
                 token_path.with_name("node.key")):
        assert path.stat().st_mode & 0o077 == 0, path
    assert token_path.parent.stat().st_mode & 0o077 == 0
    keys = load_keys(ApiSection(), tmp_path, "orchestrator")
    assert keys.identify(token_path.read_text().strip(), NOW).is_admin
    assert load_keys(ApiSection(), tmp_path, "node-agent").control is None
    assert ensure_cli_token(tmp_path, "alice") == token_path  # kept: still valid
    token_path.chmod(0o644)
    with pytest.raises(ConfigError, match="can be read by others"):
        read_secret(token_path, "API token")


def test_rotating_the_keys_invalidates_every_token(tmp_path: Path) -> None:
    token = ensure_cli_token(tmp_path, "alice").read_text().strip()
    ensure_keys(tmp_path / "credentials" / "api", rotate=True)
    with pytest.raises(TokenError, match="signature"):
        load_keys(ApiSection(), tmp_path, "orchestrator").identify(token, NOW)


@pytest.mark.parametrize("bind", ["0.0.0.0:0", "[::]:50051", "10.1.2.3:50051",
                                  "example.org:1"])
def test_no_plaintext_api_beyond_loopback(bind: str) -> None:
    with pytest.raises(ConfigError, match="without TLS"):
        server_credentials(bind, ApiSection())


def test_half_a_tls_setting_is_an_error() -> None:
    with pytest.raises(ConfigError, match="go together"):
        server_credentials("0.0.0.0:0", ApiSection(tls_cert="x.pem"))


def test_api_settings_come_from_the_environment(tmp_path: Path) -> None:
    loaded = load_config(tmp_path / "none", environ={"M27_API_TLS_CA": "/ca.pem",
                                                     "M27_API_MAX_URGENCY": "pi:urgent"})
    assert loaded.config.api.tls_ca == "/ca.pem"
    assert loaded.config.api.max_urgency == "pi:urgent"
