"""Where users meet mlxinfer outside the terminal: the menubar / tray helper (the chat page is served by server/)."""

from .controller import MenubarController

__all__ = ["MenubarController"]
