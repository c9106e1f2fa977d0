// Swagger UI for /docs, started from a file of our own rather than an inline script, so
// that the page's content security policy can forbid inline scripts as /administration's does.
window.addEventListener("load", function () {
  window.ui = SwaggerUIBundle({
    url: "/openapi.json",
    dom_id: "#swagger-ui",
    // Swagger UI would send the whole document to its public validator: nothing leaves.
    validatorUrl: null,
    deepLinking: true,
    showExtensions: true,
    presets: [SwaggerUIBundle.presets.apis, SwaggerUIBundle.SwaggerUIStandalonePreset],
    layout: "BaseLayout",
  });
});
