"""The OpenAI-compatible local server: HTTP in front of one ServingThread per loaded model.

app.py puts the app together from routes/ (one module per API) over core.py (what every route shares);
model_pool.py holds the served models, uvicorn_host.py listens and runs the app on uvicorn.
"""

from .app import create_app
from .model_pool import ModelSet, ServedModel
from .settings import ServerSettings
from .uvicorn_host import BackgroundServer, listen, serve

__all__ = ["BackgroundServer", "ModelSet", "ServedModel", "ServerSettings", "create_app", "listen", "serve"]
