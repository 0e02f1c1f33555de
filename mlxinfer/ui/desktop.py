"""Is there somewhere to show a tray icon? Asked before the model loads, so `mlxinfer menubar` fails fast, in one line.

pystray (https://github.com/moses-palmer/pystray) uses $PYSTRAY_BACKEND, else on Linux the first of appindicator,
gtk and xorg that imports. gtk and xorg dock an XEmbed icon: that needs an X display whose
`_NET_SYSTEM_TRAY_S<screen>` selection has an owner (the tray). appindicator registers with a
StatusNotifierWatcher on the session D-Bus, and falls back to XEmbed without one.
"""

from __future__ import annotations

import importlib.util
import os
import shlex
import socket
import sys
from collections.abc import Mapping
from pathlib import Path

from ..errors import TrayError
from ..server import ServerSettings

WATCHER = "org.kde.StatusNotifierWatcher"
DBUS_TIMEOUT_MS = 500
X_TCP_PORT = 6000  # display :n of a remote X server listens on TCP port 6000 + n
X_CONNECT_TIMEOUT_S = 2.0  # Xlib itself waits for the system's TCP timeout (minutes) on an unreachable host
# dummy shows nothing (tests); macOS's menubar and the Windows notification area are always there.
UNCHECKED_BACKENDS = frozenset({"dummy", "darwin", "win32"})


def require_tray(advice: str, environ: Mapping[str, str] = os.environ, platform: str = sys.platform) -> None:
    """Raise TrayError, naming what is missing and then `advice` (see `instead`), when the icon could not show.

    Example:
        >>> require_tray(instead())  # in a desktop session: returns; over ssh: raises TrayError
    """
    problem = tray_problem(environ, platform)
    if problem:
        raise TrayError(f"{problem}; {advice}")


def instead(model: str | None = None, port: int = ServerSettings.port, kv_bits: str | None = None) -> str:
    """The way out when there is no tray: `mlxinfer serve` with the model and options given to `menubar`.

    Example:
        >>> instead("/m/Qwen3 4bit", 9000)
        "run `mlxinfer serve '/m/Qwen3 4bit' --port 9000` and open http://127.0.0.1:9000/ instead"
    """
    words = ["mlxinfer", "serve", *([model] if model else [])]
    if port != ServerSettings.port:  # serve's default needs no flag
        words += ["--port", str(port)]
    if kv_bits:
        words += ["--kv-bits", str(kv_bits)]
    command = shlex.join(words)
    if port == 0:  # the port is only known once serve binds
        return f"run `{command}` instead and open the address it prints"
    return f"run `{command}` and open http://{ServerSettings.host}:{port}/ instead"


def tray_problem(environ: Mapping[str, str] = os.environ, platform: str = sys.platform) -> str | None:
    """What is missing for a tray icon, in words; None when the icon can show."""
    # pystray installs with mlxinfer where a menubar always exists (macOS, Windows); elsewhere it is an extra.
    if platform not in ("darwin", "win32") and importlib.util.find_spec("pystray") is None:
        return "the tray icon needs pystray, which installs with `pip install 'mlxinfer[tray]'`"
    if platform == "win32" or environ.get("PYSTRAY_BACKEND") == "dummy":
        return None
    if platform == "darwin":
        return _macos_session_problem()
    backend = pystray_backend(environ)
    if backend in UNCHECKED_BACKENDS:
        return None
    x_name, wayland = environ.get("DISPLAY"), environ.get("WAYLAND_DISPLAY")
    if not x_name and not wayland:
        return "no display to show a tray icon on (neither DISPLAY nor WAYLAND_DISPLAY is set)"
    problem = _xembed_problem(x_name, backend) if x_name else _no_x_problem(wayland or "", backend)
    if problem and backend == "appindicator" and _has_status_notifier_watcher(environ):
        return None
    return problem


def pystray_backend(environ: Mapping[str, str] = os.environ) -> str:
    """The backend pystray will use on Linux, found without importing pystray (whose import needs a display)."""
    chosen = environ.get("PYSTRAY_BACKEND")
    if chosen:
        return chosen
    if not _has_typelib("Gtk", "3.0"):
        return "xorg"
    indicator = _has_typelib("AppIndicator3", "0.1") or _has_typelib("AyatanaAppIndicator3", "0.1")
    return "appindicator" if indicator else "gtk"


def _xembed_problem(x_name: str, backend: str) -> str | None:
    try:
        from Xlib import X
        from Xlib import display as xdisplay
        from Xlib import error as xerror
    except ImportError:  # pystray needs python-xlib on Linux: its own import error will say so
        return None
    unreachable = _x_server_unreachable(x_name)
    if unreachable:
        return f"cannot reach X display {x_name} ({unreachable})"
    try:
        display = xdisplay.Display(x_name)
    except (xerror.DisplayError, xerror.XauthError, xerror.ConnectionClosedError, OSError) as e:
        return f"cannot open X display {x_name} ({e})"
    try:
        selection = display.intern_atom(f"_NET_SYSTEM_TRAY_S{display.get_default_screen()}")
        if display.get_selection_owner(selection) != X.NONE:
            return None
    finally:
        display.close()
    needs = "a status-notifier or XEmbed tray" if backend == "appindicator" else "an XEmbed tray"
    return f"no system tray on display {x_name} (needs {needs}, e.g. a desktop panel)"


def _x_server_unreachable(x_name: str) -> str | None:
    """Why a DISPLAY with a host part (`host:n`, e.g. ssh's `localhost:10`) does not answer in time; None if it does."""
    host, _, number = x_name.rpartition(":")
    host, number = host.removeprefix("tcp/").strip("[]"), number.split(".")[0]  # [tcp/]host:n[.screen]
    if not host or host == "unix" or "/" in host or not number.isdigit():
        return None  # a local socket (or a name Xlib will reject itself): no network wait
    try:
        socket.create_connection((host, X_TCP_PORT + int(number)), X_CONNECT_TIMEOUT_S).close()
    except OSError as e:
        return str(e) or type(e).__name__
    return None


def _macos_session_problem() -> str | None:
    """Over ssh there is no window server session, and AppKit would fail only after the model loaded."""
    try:
        from Quartz import CGSessionCopyCurrentDictionary  # pyobjc, which pystray needs on macOS
    except ImportError:
        return None
    if CGSessionCopyCurrentDictionary() is None:
        return "no macOS GUI session (logged in over ssh?)"
    return None


def _no_x_problem(wayland: str, backend: str) -> str:
    if backend == "appindicator":
        return f"no system tray on Wayland display {wayland} (needs a status-notifier tray, e.g. a desktop panel)"
    return (
        f"no tray for pystray's {backend} backend on Wayland display {wayland}: it needs X (DISPLAY is unset); "
        "PyGObject with AppIndicator would use a status-notifier tray"
    )


def _has_status_notifier_watcher(environ: Mapping[str, str]) -> bool:
    """Whether a StatusNotifierWatcher owns its name on the session bus (asked with a bounded timeout)."""
    runtime = environ.get("XDG_RUNTIME_DIR")
    if not environ.get("DBUS_SESSION_BUS_ADDRESS") and not (runtime and Path(runtime, "bus").exists()):
        return False  # no session bus: GIO would try to autolaunch one, which can take seconds
    if importlib.util.find_spec("gi") is None:
        return False
    from gi.repository import Gio, GLib

    try:
        bus = Gio.bus_get_sync(Gio.BusType.SESSION, None)
        reply = bus.call_sync(
            "org.freedesktop.DBus",
            "/org/freedesktop/DBus",
            "org.freedesktop.DBus",
            "NameHasOwner",
            GLib.Variant("(s)", (WATCHER,)),
            GLib.VariantType("(b)"),
            Gio.DBusCallFlags.NONE,
            DBUS_TIMEOUT_MS,
            None,
        )
    except GLib.Error:
        return False
    return bool(reply.unpack()[0])


def _has_typelib(namespace: str, version: str) -> bool:
    if importlib.util.find_spec("gi") is None:
        return False
    import gi

    try:
        gi.require_version(namespace, version)  # what pystray's own import does first; it loads nothing yet
    except ValueError:
        return False
    return True
