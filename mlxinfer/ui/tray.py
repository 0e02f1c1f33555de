"""The menubar (macOS) / tray (Linux) icon: pystray drawing the controller's labels and calling its actions.

pystray is imported only here and only when the icon starts: on Linux it needs
a display, and the rest of mlxinfer must import without one.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from functools import partial
from typing import Any

from PIL import Image, ImageDraw

from .controller import MenubarController

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


def build_menu(controller: MenubarController, pystray: Any) -> Any:
    """The menu; labels are callables, so they are read each time the menu is drawn."""
    item, menu = pystray.MenuItem, pystray.Menu

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
        item("Quit", lambda icon: quit_app(controller, icon)),
    )


def run_tray(controller: MenubarController) -> None:
    """Show the icon and block until Quit (or SIGTERM / Ctrl-C). Runs on the main thread (AppKit needs it)."""
    import pystray

    icon = pystray.Icon("mlxinfer", icon_image(), "mlxinfer", menu=build_menu(controller, pystray))
    controller.on_change = _on_main_thread(icon.update_menu)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: quit_app(controller, icon))
    icon.run()


def quit_app(controller: MenubarController, icon: Any) -> None:
    controller.quit()
    # Some tray backends (pystray's xorg one) can hang in stop(); everything that
    # matters is shut down already, so do not let a stuck icon keep the process.
    watchdog = threading.Timer(QUIT_GRACE_S, os._exit, args=(0,))
    watchdog.daemon = True
    watchdog.start()
    icon.stop()


def _on_main_thread(update: Any) -> Any:
    """AppKit menus may only change on the main thread; the other backends take updates from any thread."""
    if sys.platform != "darwin":
        return update
    from PyObjCTools import AppHelper

    return lambda: AppHelper.callAfter(update)


def _in_background(action: Any, *args: Any) -> None:
    # Loading a model takes seconds: keep the menu responsive.
    threading.Thread(target=action, args=args, daemon=True).start()
