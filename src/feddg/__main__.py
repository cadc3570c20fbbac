from feddg.cli import app

app()
