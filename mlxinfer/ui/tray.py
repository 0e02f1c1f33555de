"""The menubar (macOS) / tray (Linux) icon: pystray drawing the controller's labels and calling its actions.

pystray is imported only here and only when the icon starts: on Linux it needs
a display, and the rest of mlxinfer must import without one.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from functools import partial
from typing import Any

from PIL import Image, ImageDraw

from ..errors import TrayError
from .controller import MenubarController
from .desktop import instead

log = logging.getLogger("mlxinfer.menubar")

ACCENT = (47, 111, 222, 255)  # the chat page's accent colour
QUIT_GRACE_S = 3.0


def icon_image(size: int = 64) -> Image.Image:
    """A blue rounded square with three white bars (a tiny level meter)."""
    image = Image.new("RGBA", (size, size), (0, 0, 0, 0))
    draw = ImageDraw.Draw(image)
    draw.rounded_rectangle((0, 0, size - 1, size - 1), radius=size // 5, fill=ACCENT)
    bar = size // 8
    for i, height in enumerate((0.35, 0.6, 0.45)):
        left = size // 4 + i * (bar + bar // 2)
        draw.rectangle((left, int(size * (0.8 - height)), left + bar, int(size * 0.8)), fill=(255, 255, 255, 255))
    return image


def build_menu(controller: MenubarController, pystray: Any, on_quit: Callable[[Any], None] | None = None) -> Any:
    """The menu; labels are callables, so they are read each time the menu is drawn."""
    item, menu = pystray.MenuItem, pystray.Menu
    on_quit = on_quit or (lambda icon: quit_app(controller, icon))

    def models_menu() -> list[Any]:
        return [
            item(
                path.name,
                partial(_in_background, controller.switch_model, path),
                checked=lambda _, p=path: controller.current == p,
                radio=True,
            )
            for path in controller.available_models()
        ]

    return menu(
        item(lambda _: controller.model_label, None, enabled=False),
        item(lambda _: controller.speed_label, None, enabled=False),
        menu.SEPARATOR,
        item("Open Chat", lambda: controller.open_chat(), default=True),
        item("Switch Model", menu(models_menu)),
        item("Unload", lambda: controller.unload(), enabled=lambda _: controller.loaded),
        item(lambda _: "Stop Server" if controller.serving else "Start Server", lambda: controller.toggle_server()),
        menu.SEPARATOR,
        item("Quit", lambda icon: on_quit(icon)),
    )


def run_tray(controller: MenubarController) -> None:
    """Show the icon and block until Quit (or SIGTERM / Ctrl-C). Runs on the main thread (AppKit needs it).

    Raises TrayError, after stopping the controller, when pystray cannot show the icon: it fails
    to start, raises, or logs an error (xorg logs "Failed to dock icon" and would run on, iconless).
    """
    pystray = _import_pystray(controller)
    tray = _TrayRun(controller)
    menu = build_menu(controller, pystray, on_quit=lambda _: tray.quit())
    tray.icon = icon = pystray.Icon("mlxinfer", icon_image(), "mlxinfer", menu=menu)
    controller.on_change = _on_main_thread(icon.update_menu)
    handlers = {sig: signal.signal(sig, lambda *_: tray.quit()) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        with _pystray_errors(tray.fail):
            icon.run(tray.setup)
    except Exception as error:  # noqa: BLE001 - any failure of the icon is the same one-line error
        tray.fail(_reason(error))  # ignored after Quit (gtk's CloseNotification with no notification service)
    finally:
        tray.done()
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
    if tray.failure:
        raise TrayError(tray.message())


def quit_app(controller: MenubarController, icon: Any, exit_status: int = 0, message: str = "") -> threading.Timer:
    controller.quit()
    # Some tray backends (pystray's xorg one) can hang in stop(); everything that
    # matters is shut down already, so do not let a stuck icon keep the process.
    watchdog = threading.Timer(QUIT_GRACE_S, _exit_now, args=(exit_status, message))
    watchdog.daemon = True
    watchdog.start()
    icon.stop()
    return watchdog


class _TrayRun:
    """One run of the icon: whether the user quit, or why the icon failed."""

    def __init__(self, controller: MenubarController):
        self.controller, self.icon = controller, None
        self.url = controller.url  # now, while it serves: the real port, also with --port 0
        self.failure: str | None = None
        self._stopping = False
        self._stopper: threading.Thread | None = None
        self._watchdog: threading.Timer | None = None

    def setup(self, icon: Any) -> None:  # on pystray's setup thread, once its loop runs
        try:
            icon.visible = True
        except Exception as error:  # noqa: BLE001 - reported as the run's failure
            self.fail(_reason(error))

    def quit(self) -> None:
        if not self._stopping:
            self._stopping = True
            self._stop(0)

    def fail(self, reason: str) -> None:
        if self._stopping:
            return
        self._stopping, self.failure = True, reason
        # Not on this thread: it may be pystray's loop, which stop() waits for.
        self._stopper = threading.Thread(target=self._stop, args=(1,), daemon=True)
        self._stopper.start()

    def message(self) -> str:
        return f"the tray icon could not be shown ({self.failure}); {instead(self.url)}"

    def done(self) -> None:
        """After the icon's loop: the server and models are closed before the caller reports a failure."""
        if self._stopper is not None:
            self._stopper.join(QUIT_GRACE_S)
        if self.failure and self._watchdog is not None:
            # The caller reports the failure and exits; after Quit the watchdog stays, in case the exit hangs.
            self._watchdog.cancel()

    def _stop(self, exit_status: int) -> None:
        message = self.message() if exit_status else ""
        self._watchdog = quit_app(self.controller, self.icon, exit_status, message)


def _exit_now(exit_status: int, message: str) -> None:
    if message:  # the process ends here, before the CLI could say why
        log.error("Error: %s", message)
    os._exit(exit_status)


@contextlib.contextmanager
def _pystray_errors(on_error: Callable[[str], None]) -> Iterator[None]:
    """pystray logs some failures (with a traceback) instead of raising: turn them into `on_error` calls."""

    class Report(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            on_error(f"pystray: {record.getMessage()}")

    logger = logging.getLogger("pystray")
    handler, propagate = Report(logging.ERROR), logger.propagate
    logger.addHandler(handler)
    logger.propagate = False  # its traceback is not for the user
    try:
        yield
    finally:
        logger.removeHandler(handler)
        logger.propagate = propagate


def _import_pystray(controller: MenubarController) -> Any:
    try:
        import pystray
    except Exception as error:  # noqa: BLE001 - without a display its xorg backend raises Xlib errors, not ImportError
        controller.quit()
        raise TrayError(f"pystray cannot start ({_reason(error)}); {instead(controller.url)}") from None
    return pystray


def _reason(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}" if str(error) else type(error).__name__


def _on_main_thread(update: Any) -> Any:
    """AppKit menus may only change on the main thread; the other backends take updates from any thread."""
    if sys.platform != "darwin":
        return update
    from PyObjCTools import AppHelper

    return lambda: AppHelper.callAfter(update)


def _in_background(action: Any, *args: Any) -> None:
    # Loading a model takes seconds: keep the menu responsive.
    threading.Thread(target=action, args=args, daemon=True).start()
