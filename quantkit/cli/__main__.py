from quantkit.cli import app

app()
