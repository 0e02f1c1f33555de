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

from ..errors import MlxInferError, TrayError
from .controller import MenubarController

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
    """The menu; labels are callables, so they are read each time the menu is drawn.

    An action that fails (a taken port, a model that does not load) shows "Error: ..." in place of
    the model line until the next action succeeds, and logs it; it never reaches pystray's loop.
    """
    item, menu = pystray.MenuItem, pystray.Menu
    on_quit = on_quit or (lambda icon: quit_app(controller, icon))
    shown = _ActionErrors(controller)

    def models_menu() -> list[Any]:
        return [
            item(
                controller.name_of(path),
                partial(_in_background, shown.wrap(controller.switch_model, path)),
                checked=lambda _, p=path: controller.current == p,
                radio=True,
            )
            for path in controller.available_models()
        ]

    return menu(
        item(lambda _: shown.error or controller.model_label, None, enabled=False),
        item(lambda _: controller.speed_label, None, enabled=False),
        menu.SEPARATOR,
        item("Open Chat", shown.wrap(controller.open_chat), default=True),
        item("Switch Model", menu(models_menu)),
        item("Unload", shown.wrap(controller.unload), enabled=lambda _: controller.loaded),
        item(lambda _: "Stop Server" if controller.serving else "Start Server", shown.wrap(controller.toggle_server)),
        menu.SEPARATOR,
        item("Quit", lambda icon: on_quit(icon)),
    )


class _ActionErrors:
    """The last menu action's error, shown in the menu: a failed click must not vanish (or end the icon's loop)."""

    def __init__(self, controller: MenubarController):
        self.controller, self.error = controller, None

    def wrap(self, action: Callable[..., None], *args: Any) -> Callable[[], None]:
        def run() -> None:
            try:
                action(*args)
            except MlxInferError as error:
                log.error("Error: %s", error)
                self.error = f"Error: {error}"
            else:
                self.error = None
            self.controller.on_change()  # redraw: the error appeared or went

        return run


def run_tray(controller: MenubarController, advice: str) -> None:
    """Show the icon and block until Quit (or SIGTERM / Ctrl-C). Runs on the main thread (AppKit needs it).

    Raises TrayError ending in `advice` (`desktop.instead`), after stopping the controller, when pystray
    cannot show the icon: it fails to start, raises, or logs an error while showing it (xorg logs
    "Failed to dock icon" and would run on, iconless). Errors it logs once the icon shows (a panel that
    restarts) are one warning each, and serving goes on; a loop that ends by itself stops the helper.
    """
    pystray = _import_pystray(controller, advice)
    tray = _TrayRun(controller, advice)
    menu = build_menu(controller, pystray, on_quit=lambda _: tray.quit())
    tray.icon = icon = pystray.Icon("mlxinfer", icon_image(), "mlxinfer", menu=menu)
    controller.on_change = _on_main_thread(icon.update_menu)
    handlers = {sig: signal.signal(sig, lambda *_: tray.quit()) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        with _pystray_errors(tray.report):
            icon.run(tray.setup)
        tray.fail(tray.last_warning or "its loop ended")  # ignored after Quit; else nothing could quit the helper
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

    def __init__(self, controller: MenubarController, advice: str):
        self.controller, self.icon, self.advice = controller, None, advice
        self.failure: str | None = None
        self.is_shown = False  # until then any error means there is no icon
        self.last_warning: str | None = None
        self._warned: set[str] = set()
        self._stopping = False
        self._stopper: threading.Thread | None = None
        self._watchdog: threading.Timer | None = None

    def setup(self, icon: Any) -> None:  # on pystray's setup thread, once its loop runs
        try:
            icon.visible = True  # xorg docks here, and logs (not raises) a failure before returning
        except Exception as error:  # noqa: BLE001 - reported as the run's failure
            self.fail(_reason(error))
        self.is_shown = self.failure is None

    def report(self, reason: str) -> None:
        """An error pystray logged: fatal while the icon is being shown, one warning each after that."""
        if not self.is_shown:
            self.fail(reason)
            return
        self.last_warning = reason  # the reason, should pystray's loop end after it (xorg's does)
        if reason not in self._warned:  # a panel that restarts again and again says it once
            self._warned.add(reason)
            log.warning("Warning: the tray icon reported an error (%s); serving goes on", reason)

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
        what = "stopped" if self.is_shown else "could not be shown"
        return f"the tray icon {what} ({self.failure}); {self.advice}"

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


def _import_pystray(controller: MenubarController, advice: str) -> Any:
    try:
        import pystray
    except Exception as error:  # noqa: BLE001 - without a display its xorg backend raises Xlib errors, not ImportError
        controller.quit()
        raise TrayError(f"pystray cannot start ({_reason(error)}); {advice}") from None
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
