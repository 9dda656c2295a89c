"""toolkit.export.maps, predict --plot's drawing: the polar-stereographic projection computed by hand, the cells'
corners (a seam that wraps, a row next to the pole), one PNG per field with a panel per hemisphere holding domain
cells, and a --plot path that cannot be a directory refused in one line before anything is drawn."""

from __future__ import annotations

import numpy as np
import pytest

from toolkit.errors import UsageError
from toolkit.export.maps import (
    EARTH_RADIUS_KM,
    MapField,
    cell_corners,
    check_plot_dir,
    draw_maps,
    periodic_columns,
    polar_stereographic,
)


def test_polar_stereographic_by_hand():
    x, y = polar_stereographic(np.array([90.0, 0.0, 0.0, 60.0]), np.array([0.0, 0.0, 90.0, 180.0]), "north")
    assert np.allclose([x[0], y[0]], 0.0)  # the pole in the middle
    assert np.allclose([x[1], y[1]], [0.0, -2 * EARTH_RADIUS_KM])  # the equator at 2 R, 0 degrees east down
    assert np.allclose([x[2], y[2]], [2 * EARTH_RADIUS_KM, 0.0])  # 90 degrees east to the right
    assert np.isclose(np.hypot(x[3], y[3]), 2 * EARTH_RADIUS_KM * np.tan(np.radians(15.0))) and y[3] > 0
    sx, sy = polar_stereographic(np.array([-90.0, -60.0, -60.0]), np.array([0.0, 0.0, 90.0]), "south")
    assert np.allclose([sx[0], sy[0]], 0.0)
    assert sy[1] > 0 and np.isclose(sx[1], 0.0) and sx[2] > 0  # the south's 0 degrees east up, 90 east right
    assert np.isclose(np.hypot(sx[1], sy[1]), np.hypot(x[3], y[3]))  # symmetric poles


def test_cell_corners_wrap_the_seam_and_close_at_the_pole():
    lat1 = np.array([60.0, 70.0, 80.0])
    lon1 = (np.arange(12) + 0.5) * 30.0
    lat, lon = np.meshgrid(lat1, lon1, indexing="ij")
    assert periodic_columns(lon) and not periodic_columns(lon[:, :6])
    x, y = polar_stereographic(lat, lon, "north")
    cx, cy = cell_corners(x, True), cell_corners(y, True)
    assert cx.shape == (4, 13)
    assert np.allclose(cx[:, 0], cx[:, -1]) and np.allclose(cy[:, 0], cy[:, -1])  # the seam closes
    # the rows' edges half-way: the top row (80 degrees) ends at 85, its corners on the chord between meridians
    edge85 = 2 * EARTH_RADIUS_KM * np.tan(np.radians(2.5)) * np.cos(np.radians(15.0))
    assert np.allclose(np.hypot(cx[-1], cy[-1]), edge85, rtol=0.02)
    flat = cell_corners(np.arange(6.0).reshape(2, 3), False)
    assert np.allclose(flat, [[-2.0, -1.0, 0.0, 1.0], [1.0, 2.0, 3.0, 4.0], [4.0, 5.0, 6.0, 7.0]])  # half-way


def test_draw_maps_one_png_per_field_a_panel_per_hemisphere(tmp_path):
    lat1 = (np.arange(18) + 0.5) * 10.0 - 90.0
    lon1 = (np.arange(24) + 0.5) * 15.0
    lat, lon = np.meshgrid(lat1, lon1, indexing="ij")
    polar = np.abs(lat) >= 50
    land = np.zeros(lat.shape, dtype=bool)
    land[2:4, 3:9] = True
    both = np.where(polar & ~land, np.cos(np.radians(lon)) * (np.abs(lat) - 50) / 40, np.nan)
    north_only = np.where(lat >= 50, 0.5, np.nan)
    fields = [MapField("aice", "emulated aice", "1", np.clip(both, 0, 1), "fraction"),
              MapField("daice_dsst", "d aice / d sst", "1/K", both),
              MapField("north", "north only", "", north_only),
              MapField("nothing", "no cells", "", np.full(lat.shape, np.nan))]  # no domain cells: no map
    written = draw_maps(tmp_path / "maps", fields, lat, lon, land)
    assert [p.name for p in written] == ["aice.png", "daice_dsst.png", "north.png"]
    assert sorted(p.name for p in (tmp_path / "maps").iterdir()) == sorted(p.name for p in written)
    sizes = {p.name: p.stat().st_size for p in written}
    for path in written:
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    from PIL import Image

    widths = {name: Image.open(tmp_path / "maps" / name).size[0] for name in sizes}
    assert widths["north.png"] < widths["aice.png"] == widths["daice_dsst.png"]  # one panel, two panels


def test_plot_dir_that_cannot_be_a_directory_is_refused(tmp_path):
    (tmp_path / "file").write_text("x\n")
    with pytest.raises(UsageError, match="is a file; give a directory"):
        check_plot_dir(tmp_path / "file")
    with pytest.raises(UsageError, match="file is a file, not a directory"):
        check_plot_dir(tmp_path / "file" / "maps" / "deeper")
    assert check_plot_dir(tmp_path / "new" / "maps") == tmp_path / "new" / "maps"
    assert not (tmp_path / "new").exists()  # checked, not created
