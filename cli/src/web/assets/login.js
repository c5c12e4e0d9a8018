// Trades the login token for the HttpOnly cookie; the token travels only in a POST body.
"use strict";

document.getElementById("login").addEventListener("submit", async (event) => {
  event.preventDefault();
  const error = document.getElementById("error");
  try {
    await api("POST", "/login", { token: document.getElementById("token").value });
    location.href = "/";
  } catch (e) {
    error.textContent = e.message;
    error.hidden = false;
  }
});
