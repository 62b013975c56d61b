"""The retrain deployment's schedule as built (no Prefect server): cron and time zone from `deploy.*`."""
import pytest

from flows.deploy import deployments
from tlt.config import ConfigError, build_config


def test_retrain_schedule_carries_cron_and_timezone():
    cfg = build_config({}, ["deploy.cron=30 2 * * 1", "deploy.timezone=Europe/Paris"])
    manual, retrain = deployments(cfg)
    assert not manual.schedules
    (sched,) = retrain.schedules
    assert sched.schedule.cron == "30 2 * * 1" and sched.schedule.timezone == "Europe/Paris"
    assert retrain.parameters["retrain"] is True


def test_unknown_timezone_is_refused_with_the_key():
    with pytest.raises(ConfigError, match=r"'deploy.timezone'.*not an IANA time zone"):
        build_config({}, ["deploy.timezone=Mars/Olympus"])
