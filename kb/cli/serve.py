"""`kb serve`: the REST API (kb/server/), MLflow-compatible tracking endpoints and the UI at /ui,
under uvicorn; `kb ui`: the same server, opening the UI in a browser.

    kb serve                                   # http://127.0.0.1:8000, writes need no token
    KB_API_TOKENS=tok1,tok2 kb serve --host 0.0.0.0 --port 8000
    kb serve --port 0                          # any free port; the first line says which
    kb ui                                      # http://127.0.0.1:8000/ui/, opened in a browser
"""
from __future__ import annotations

import ipaddress
import signal
import socket
import threading

import click


def register(cli: click.Group) -> None:
    cli.add_command(serve)
    cli.add_command(ui)
    cli.add_command(token)


host_option = click.option("--host", default="127.0.0.1", show_default=True,
                           help="Interface to listen on; other than loopback only with KB_API_TOKENS set.")
port_option = click.option("--port", type=click.IntRange(0, 65535), default=8000, show_default=True,
                           help="TCP port; 0 picks a free one.")


@click.command()
@host_option
@port_option
@click.option("--no-ui", is_flag=True, help="Serve the API only (no Gradio UI at /ui).")
@click.pass_obj
def serve(obj, host, port, no_ui):
    """Serve the REST API (/api, OpenAPI at /openapi.json), MLflow's tracking API (/api/2.0/mlflow)
    and the UI (/ui)."""
    run_server(obj, host, port, ui=not no_ui)


@click.command()
@host_option
@port_option
@click.option("--no-browser", is_flag=True, help="Print the UI's address without opening a browser.")
@click.pass_obj
def ui(obj, host, port, no_browser):
    """Serve the UI (and the API beside it) and open it in a browser."""
    run_server(obj, host, port, ui=True, open_browser=not no_browser)


@click.command()
@click.option("--hash", "to_hash", metavar="TOKEN",
              help="Print the sha256: form of this token instead of a new one ('-': read it from stdin).")
def token(to_hash):
    """Make a new API token: prints the token (give it to clients) and its `sha256:` form (put that
    in KB_API_TOKENS or KB_API_READ_TOKENS, so the server never holds the token itself)."""
    from kb.server.auth import hashed, new_token
    if to_hash is not None:
        click.echo(hashed(click.get_text_stream("stdin").readline().strip() if to_hash == "-" else to_hash))
        return
    made = new_token()
    click.echo(f"token:  {made}\nconfig: {hashed(made)}")


def run_server(obj, host: str, port: int, *, ui: bool = True, open_browser: bool = False,
               before=None) -> None:
    """Listen, then serve until SIGINT/SIGTERM. `before(url)` runs once the socket is bound."""
    from kb.errors import KBError
    settings = obj.settings
    if not (settings.tokens or settings.read_tokens) and not _is_loopback(host):
        raise click.UsageError(f"--host {host} is not a loopback address, and no KB_API_TOKENS is set: "
                               "anyone who reaches it could write; set tokens, or serve on 127.0.0.1")
    try:
        sock = _listen(host, port)
    except socket.gaierror as exc:
        raise click.BadParameter(f"{host!r}: {exc.strerror or exc}", param_hint="--host") from None
    except OSError as exc:
        raise KBError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    import uvicorn

    from kb.server.app import create_app
    bound = sock.getsockname()[1]
    url = f"http://[{host}]:{bound}" if ":" in host else f"http://{host}:{bound}"
    click.echo(f"kb serve: {url} (API /api, OpenAPI /openapi.json, MLflow tracking URI {url})", err=True)
    if settings.tokens or settings.read_tokens:
        reads = (f"reads need one too ({len(settings.read_tokens)} read-only in KB_API_READ_TOKENS)"
                 if settings.read_tokens else "reads are open")
        click.echo(f"writes need a bearer token ({len(settings.tokens)} set in KB_API_TOKENS); {reads}", err=True)
    else:
        click.echo("no KB_API_TOKENS set: listening on loopback only, and writes need no token", err=True)
    if ui:
        click.echo(f"UI: {url}/ui/", err=True)
    app = create_app(obj.kb(), ui=ui)
    if before is not None:
        before(url)
    if open_browser:
        import webbrowser
        threading.Timer(1.0, webbrowser.open, (f"{url}/ui/",)).start()
    config = uvicorn.Config(app, log_level="info" if obj.verbose else "warning", access_log=obj.verbose)
    # uvicorn shuts down on SIGINT or SIGTERM, then raises the signal again for the handler it
    # found: a no-op for SIGTERM and a caught KeyboardInterrupt for Ctrl-C end the command
    # normally, so the knowledge base is closed and the exit status is 0
    previous = signal.signal(signal.SIGTERM, lambda *_: None)
    try:
        uvicorn.Server(config).run(sockets=[sock])
    except KeyboardInterrupt:
        pass
    finally:
        signal.signal(signal.SIGTERM, previous)
        sock.close()


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False           # a name: it may resolve to anything


def _listen(host: str, port: int) -> socket.socket:
    family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
        sock.listen(2048)
    except OSError:
        sock.close()
        raise
    sock.set_inheritable(True)
    return sock
