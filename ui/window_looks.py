"""The window's looks: its themes, presenter mode, and its size on the screen it is on.

Presenter mode is full screen, large type, thick lines and high contrast, with the controls hidden (the keys
drive); the Live tab lays its columns out for it and for the window's width (``kvscope.ui.live_tab.LiveTab``).
``WindowLooks`` is mixed into ``kvscope.ui.main_window.MainWindow``.
"""

from __future__ import annotations

from PySide6.QtCore import QTimer
from PySide6.QtGui import QGuiApplication

from kvscope.ui.theme import stylesheet, theme as make_theme

#: Shorter than this, the first start's offer is its button alone (its three wrapped lines crushed the plots).
COMPACT_BANNER_BELOW_H = 700


class WindowLooks:
    """Themes, presenter mode and the window's geometry on its screen (the parts restyle themselves)."""

    def set_theme(self, name: str) -> None:
        self.theme_name = "light" if name == "light" else "dark"
        self.apply_theme()

    def set_presenter(self, on: bool, fullscreen: bool = True) -> None:
        """Presenter mode: full screen, large type, thick lines, high contrast; the controls hide (keys drive)."""
        was = self.presenter
        self.presenter = bool(on)
        self.presenter_action.setChecked(self.presenter)
        if self.presenter and not was:
            self._normal_geometry = self.saveGeometry()  # leaving presenter mode puts the window back
        screen = self.screen() or QGuiApplication.primaryScreen()
        wide = screen is None or screen.availableGeometry().width() >= 1600
        self.live.presenter_layout(self.presenter, was, wide)
        self.apply_theme()
        self.live.fit_to_width(self.width(), self.presenter)  # the controls come and go: the plots' column changes
        # The controls come back after the normal type is in force: shown while the presenter type's wide badges
        # still were, they would grow the window past its normal size.
        self.controls.setVisible(not self.presenter)
        if fullscreen:
            if self.presenter:
                self.showFullScreen()
            else:
                self.showNormal()
        if not self.presenter and was and getattr(self, "_normal_geometry", None) is not None:
            # After the normal layout's minimum sizes are in force (pending layout requests), else the presenter
            # layout's wider minimum would clamp the restored width.
            geometry = self._normal_geometry

            def give_back() -> None:
                # The window's minimum is what its layout last set: still the presenter layout's until activated
                # (it clamped a 764 px window to 796 px).
                self.layout().activate()
                self.restoreGeometry(geometry)
                self.live.restore_centre()

            QTimer.singleShot(0, give_back)

    def apply_theme(self) -> None:
        old = self.theme
        self.theme = make_theme(self.theme_name, self.presenter)
        self.setStyleSheet(stylesheet(self.theme))
        self.live.apply_theme(old, self.theme)
        self.calculator.apply_theme(self.theme)
        self.servers.apply_theme(self.theme)
        if self.theme_name in getattr(self, "theme_actions", {}):
            self.theme_actions[self.theme_name].setChecked(True)
        self._show_state(self.state)

    def resizeEvent(self, event) -> None:  # noqa: N802 - Qt's name
        super().resizeEvent(event)
        self.live.fit_to_width(self.width(), self.presenter)
        self.demo_banner.set_compact(self.height() < COMPACT_BANNER_BELOW_H)

    def fit_to_screen(self) -> None:
        """Never larger than the screen's free area (a 1280x720 projector, a remembered size from a bigger
        monitor): shrink to it, title bar included, and move fully onto it."""
        screen = self.screen() or QGuiApplication.primaryScreen()
        if screen is None:
            return
        free = screen.availableGeometry()
        title = 32  # the window manager's title bar, not part of our geometry before the window is shown
        width, height = min(self.width(), free.width()), min(self.height(), free.height() - title)
        if (width, height) != (self.width(), self.height()):
            self.resize(max(width, self.minimumSizeHint().width()), max(height, self.minimumSizeHint().height()))
            self.move(free.left(), free.top())
