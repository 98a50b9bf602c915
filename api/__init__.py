"""The FastAPI gateway. `api.main.create_app` builds the app; one router module per resource."""
