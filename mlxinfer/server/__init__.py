"""The OpenAI-compatible local server: HTTP in front of one Scheduler per loaded model."""

from .app import create_app
from .models import ModelSet, ServedModel
from .run import listen, serve
from .settings import ServerSettings

__all__ = ["ModelSet", "ServedModel", "ServerSettings", "create_app", "listen", "serve"]
