"""``GET /v1/config``: the settings the server runs the queue with (`gpuq config`), as far as the
caller may see them.

Everyone the server serves (and the public view) sees what `scontrol show config` shows: the
scheduling, limits, time, sharing, sampling and snapshot settings, the admins, the nodes and paths.
Where gpuq's database and broker are, and how to reach them, is root's and the admins' alone
(``ADMIN_ONLY``): with its password masked a URL still names a host, a user and a database, and
nobody needs them to use the queue. Nobody is sent a secret: every value is masked as `gpuq config`
masks it (``settings.masked``), root's too, so the database and broker passwords never leave the server.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from aiohttp import web

from gpuq.server.request import call, context
from gpuq.service import constants as c
from gpuq.service.errors import ConfigError
from gpuq.service.rights import Caller, is_admin
from gpuq.service.settings import ENV_PREFIX, Settings, config_file, setting_sources, shown_settings

routes = web.RouteTableDef()

# The settings only root and the admins are shown: the database's and the broker's addresses (the
# URLs, the managed Redis's port, the prefix of gpuq's keys there), and the path of the TCP
# listener's private key.
ADMIN_ONLY = frozenset({"database_url", "broker_url", "redis_port", "key_prefix", "tls_key"})
# A setting's source where the server's own process, reading its settings again, finds another value
# than the one it runs with: a server started with settings of its own (in a test), or a config
# file edited since it started.
GIVEN = "given"


@routes.get(c.API_PREFIX + "/config")
async def config(request: web.Request) -> web.Response:
    """The server's settings, what the caller may see of them, and its config file."""
    settings, caller = context(request)
    return web.json_response(await call(shown, settings, is_admin(settings, caller)))


def shown(settings: Settings, admin: bool) -> dict[str, Any]:
    """``GET /v1/config``'s answer: ``settings`` as `gpuq config` prints them, those in ADMIN_ONLY
    withheld (``value`` and ``source`` null, ``withheld`` true) unless ``admin``."""
    listed = shown_settings(settings, _sources(settings))
    if os.geteuid() != 0:
        # A user's own stack has its user as admin too (rights.is_admin): said beside the setting,
        # which read as "no admin" while /v1/whoami said admin.
        listed["admins"]["also"] = Caller.of_uid(os.geteuid()).user
    if not admin:
        for name in ADMIN_ONLY:
            listed[name] = {"value": None, "source": None, "env": ENV_PREFIX + name.upper(), "withheld": True}
    path = config_file()
    return {"admin": admin, "config_file": str(path), "config_file_exists": path.is_file(), "settings": listed}


def _sources(settings: Settings) -> dict[str, str]:
    """Where each setting the server runs with came from (env, file or default), as its process
    reads them now; GIVEN where that reading does not give the value it runs with."""
    names = [f.name for f in dataclasses.fields(settings)]
    try:
        read, _, sources = setting_sources()
    except ConfigError:  # a file broken since the server started: it runs with what it read then
        return dict.fromkeys(names, GIVEN)
    return {name: sources[name] if getattr(read, name) == getattr(settings, name) else GIVEN for name in names}
