"""Polar-stereographic maps of what `python -m toolkit.export predict --plot DIR` emulated: one PNG per field (the
emulated output, its error against the input's values where the input holds them, each Jacobian column), the
north and south polar caps side by side (a hemisphere without domain cells is left out), each panel titled with its
cells' mean, std, min, max and count.

    fields = [MapField("aice", "emulated aice", "1", grid_values, "fraction"), ...]   # NaN outside the domain
    draw_maps(Path("maps"), fields, lat, lon, land)                                     # -> [maps/aice.png, ...]

The projection is computed here (polar_stereographic: the sphere projected from the opposite pole onto the plane
tangent at the pole, true scale at the pole), with matplotlib only: cartopy would add a dependency and download its
coastlines at draw time, where the grid's own ocean mask already draws the land (grey). Latitude circles every 10
degrees, meridians every 30. A signed field's colours are symmetric around 0 and saturate at the 99th percentile of
its |values| (both hemispheres, one scale); a fraction's span 0 .. 1. Each PNG is written whole or not at all."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from toolkit.errors import UsageError
from toolkit.process import extras
from toolkit.run.tracking import save_png

EARTH_RADIUS_KM = 6371.0
POLES = (("north", 1.0), ("south", -1.0))
DPI = 80
OUTSIDE = "0.88"  # the ocean outside the domain (and off the grid): light grey, apart from any colour of a field
LAND = "0.55"  # the mask's land: darker grey


@dataclass
class MapField:
    """One field to map: its file's stem (aice, aice_error, daice_dsst), its name in words, its units, its values on
    the grid (NaN outside the domain) and its kind: "fraction" (colours 0 .. 1) or "signed" (symmetric around 0)."""

    name: str
    label: str
    units: str
    values: np.ndarray
    kind: str = "signed"


def check_plot_dir(path: Path | str) -> Path:
    """--plot DIR as a directory to create or fill, else one line (a file there, a file above it, no write access),
    before anything is computed or written."""
    path = Path(path).expanduser()
    if path.exists() and not path.is_dir():
        raise UsageError(f"--plot {path} is a file; give a directory for the maps (created where missing)")
    existing = path
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir():
        raise UsageError(f"--plot {path}: {existing} is a file, not a directory")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise UsageError(f"--plot {path}: {existing} is not writable; give a directory you can write to")
    return path


def polar_stereographic(lat: np.ndarray, lon: np.ndarray, pole: str) -> tuple[np.ndarray, np.ndarray]:
    """(x, y) in km on the plane tangent at the pole ("north" or "south"): the distance from the pole is
    2 R tan(colatitude / 2); the north's 0 degrees east points down, the south's up, 90 degrees east right in both."""
    sign = 1.0 if pole == "north" else -1.0
    colatitude = np.radians(90.0 - sign * np.asarray(lat, dtype=np.float64))
    rho = 2.0 * EARTH_RADIUS_KM * np.tan(colatitude / 2.0)
    lam = np.radians(np.asarray(lon, dtype=np.float64))
    return rho * np.sin(lam), -sign * rho * np.cos(lam)


def periodic_columns(lon: np.ndarray) -> bool:
    """Whether the grid's last column neighbours its first (a global grid in longitude): the step from the last to
    the first is about the step between columns."""
    if lon.shape[1] < 3:
        return False
    step = np.nanmedian((lon[:, 1] - lon[:, 0]) % 360.0)
    wrap = np.nanmedian((lon[:, 0] - lon[:, -1]) % 360.0)
    return bool(step > 0 and abs(wrap - step) < 0.5 * step)


def cell_corners(centres: np.ndarray, periodic: bool) -> np.ndarray:
    """[rows + 1, columns + 1] corners of the cells around [rows, columns] centres (one projected coordinate): each
    corner the mean of its four neighbouring centres, the grid padded by a row/column extrapolated linearly (the
    outer rows' corners half a row beyond them, the pole for a row half a row from it), or by the opposite column
    where the columns wrap around."""
    rows, columns = centres.shape
    padded = np.empty((rows + 2, columns + 2))
    padded[1:-1, 1:-1] = centres
    padded[0, 1:-1] = 2 * centres[0] - centres[min(1, rows - 1)]
    padded[-1, 1:-1] = 2 * centres[-1] - centres[max(rows - 2, 0)]
    if periodic:
        padded[:, 0], padded[:, -1] = padded[:, -2], padded[:, 1]
    else:
        padded[:, 0] = 2 * padded[:, 1] - padded[:, 2]
        padded[:, -1] = 2 * padded[:, -2] - padded[:, -3]
    return 0.25 * (padded[:-1, :-1] + padded[1:, :-1] + padded[:-1, 1:] + padded[1:, 1:])


def statistics_line(values: np.ndarray) -> str:
    return (f"mean {values.mean():.3g}, std {values.std():.3g}\nmin {values.min():.3g}, max {values.max():.3g}, "
            f"{values.size} cells")


def draw_maps(directory: Path | str, fields: list[MapField], lat: np.ndarray, lon: np.ndarray,
              land: np.ndarray | None = None) -> list[Path]:
    """One PNG per field in `directory` (created where missing), named <field.name>.png; returns their paths."""
    plt = extras.pyplot()
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    lat, lon = np.asarray(lat, dtype=np.float64), np.asarray(lon, dtype=np.float64)
    wrap = periodic_columns(lon)
    written = []
    for item in fields:
        values = np.asarray(item.values, dtype=np.float64)
        poles = [(pole, sign) for pole, sign in POLES if (np.isfinite(values) & (sign * lat > 0)).any()]
        if not poles:
            continue
        finite = values[np.isfinite(values)]
        if item.kind == "fraction":
            limits, cmap = (0.0, 1.0), "Blues_r"
        else:
            top = float(np.percentile(np.abs(finite), 99)) or float(np.abs(finite).max()) or 1.0
            limits, cmap = (-top, top), "RdBu_r"
        fig, axes = plt.subplots(1, len(poles), figsize=(4.6 * len(poles) + 0.8, 5.0), squeeze=False)
        mesh = None
        for ax, (pole, sign) in zip(axes[0], poles, strict=True):
            mesh = draw_pole(ax, values, lat, lon, land, pole, sign, limits, cmap, wrap)
            inside = values[np.isfinite(values) & (sign * lat > 0)]
            ax.set_title(f"{pole}: {statistics_line(inside)}", fontsize=9)
        colorbar = fig.colorbar(mesh, ax=list(axes[0]), orientation="horizontal", fraction=0.05, pad=0.04,
                                extend="neither" if item.kind == "fraction" else "both")
        colorbar.set_label(f"{item.label} [{item.units}]" if item.units else item.label)
        fig.suptitle(item.label, fontsize=11)
        path = directory / f"{item.name}.png"
        save_png(fig, path, dpi=DPI)
        written.append(path)
    return written


def draw_pole(ax, values, lat, lon, land, pole: str, sign: float, limits, cmap: str, wrap: bool):
    """One polar cap: the field's cells, the land grey, the graticule; axes limited to the field's cells."""
    rows = (sign * lat > 0).any(axis=1)  # the grid rows reaching this hemisphere
    lat_p, lon_p, values_p = lat[rows], lon[rows], values[rows]
    hemisphere = sign * lat_p > 0
    x, y = polar_stereographic(lat_p, lon_p, pole)
    corners_x, corners_y = cell_corners(x, wrap), cell_corners(y, wrap)
    shown = np.isfinite(values_p) & hemisphere
    extent = 1.04 * float(np.hypot(corners_x, corners_y)[:-1, :-1][shown].max())
    from matplotlib.colors import ListedColormap

    ax.set_facecolor(OUTSIDE)
    if land is not None and (land[rows] & hemisphere).any():
        ax.pcolormesh(corners_x, corners_y, np.ma.masked_where(~(land[rows] & hemisphere), np.ones_like(x)),
                      shading="flat", cmap=ListedColormap([LAND]), vmin=0.0, vmax=1.0, rasterized=True)
    mesh = ax.pcolormesh(corners_x, corners_y, np.ma.masked_where(~shown, values_p), shading="flat", cmap=cmap,
                         vmin=limits[0], vmax=limits[1], rasterized=True)
    circle = np.linspace(0.0, 360.0, 181)
    for parallel in range(10, 90, 10):
        cx, cy = polar_stereographic(np.full_like(circle, sign * parallel), circle, pole)
        if np.hypot(cx[0], cy[0]) <= extent:
            ax.plot(cx, cy, color="0.3", linewidth=0.4)
            if parallel % 20 == 0:
                ax.text(cx[68], cy[68], f"{parallel}°{'N' if sign > 0 else 'S'}", fontsize=6, color="0.2")
    edge = 90.0 - np.degrees(2.0 * np.arctan(extent / (2.0 * EARTH_RADIUS_KM)))  # the latitude at the extent
    for meridian in range(0, 360, 30):
        mx, my = polar_stereographic(np.array([sign * edge, sign * 90.0]), np.array([meridian, meridian]), pole)
        ax.plot(mx, my, color="0.4", linewidth=0.4)
    ax.set_xlim(-extent, extent)
    ax.set_ylim(-extent, extent)
    ax.set_aspect("equal")
    ax.set_xticks([])
    ax.set_yticks([])
    return mesh
